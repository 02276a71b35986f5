# No vLLM (carry .devbundle/site.tar.xz): the fused head's and the batched vision attention's CUDA tests, the
# vision tower alone (loop vs batched), the 0.5B training/reference passes with the fused head vs the logits.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/site && tar -xJf .devbundle/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 55 python -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_fused_head_cuda.py tests/gpu/test_vision_attention_cuda.py 2>&1 | tee $OUT/cuda_tests.log | grep -E "passed|failed|assert|GiB|peak|Error" | head -12
timeout 40 python benchmarks/vision_attention.py --device cuda --hidden 1280 --heads 16 --depth 32 --intermediate 3420 --images 16 2>&1 | tee $OUT/vattn.log | grep -v Warn | tail -8
timeout ${TP_T:-100} python benchmarks/train_passes.py --no-compile --micro-batches 64 --chunks 1760 --new-shapes 0 --repeat 2 2>&1 | tee $OUT/passes.log | grep -v Warn | tail -14
