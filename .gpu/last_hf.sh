# No vLLM: the small bundle (ray, pydantic). Recovery of a killed engine on the GPU path (hf engine), then the
# fsdp2/pinned-offload GPU tests (fused AdamW beside offload). carry .devbundle/site.tar.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/site && tar -xJf .devbundle/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 140 python -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_engine_recovery_gpu.py 2>&1 | tee $OUT/recovery.log | grep -E "passed|failed|Error|assert|SKIP" | head -20
[ "${FSDP:-0}" = 1 ] && timeout 100 python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_fsdp2_cuda.py tests/gpu/test_pinned_offload_cuda.py 2>&1 | tee $OUT/fsdp2.log | grep -E "passed|failed|Error|assert|SKIP" | head -20
