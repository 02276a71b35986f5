# No vLLM (carry .devbundle/site.tar.xz): the CUDA tests of what was built since the last GPU run, the
# trainer passes (fused head; 64/128/256 rows a pass), the first vs later offload of a 3B trainer's state.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/site && tar -xJf .devbundle/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${T_T:-170} python -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_fused_head_cuda.py tests/gpu/test_vision_attention_cuda.py tests/gpu/test_pinned_offload_cuda.py tests/gpu/test_host_syncs_cuda.py tests/gpu/test_fsdp2_load_cuda.py 2>&1 | tee $OUT/cuda_tests.log | grep -E "passed|failed|skipped|assert|GiB|peak|Error|SKIP" | head -30
timeout ${TP_T:-130} python benchmarks/train_passes.py --no-compile --micro-batches 64 --chunks 1760 --new-shapes 0 --repeat 2 2>&1 | tee $OUT/passes.log | grep -v Warn | tail -18
[ "${OF_T:-0}" -gt 0 ] && timeout ${OF_T} python benchmarks/offload.py --model-size 3b 2>&1 | tee $OUT/offload.log | grep -v Warn | tail -12
