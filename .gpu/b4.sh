# Stage part 3 (carry .devbundle/vllm/p3 .devbundle/mcore.tar.xz), then Megatron's GPU tests and the vLLM GPU tests.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -f /tmp/site/.unpacked ] || cp .devbundle/vllm/p3/* /tmp/vstage/; source .gpu/env.sh || exit 3
tar -xJf .devbundle/mcore.tar.xz -C /tmp/site && python -c "import megatron.core as m; print('megatron-core', m.__version__)"
set -o pipefail
timeout ${MG_T:-200} python -m pytest -q -p no:cacheprovider -rs -m "not long and not slow" tests/gpu/test_megatron.py 2>&1 | tee $OUT/megatron.log | grep -E "passed|failed|PASS|FAIL|Error|assert|SKIP|tolerance|loss" | head -40
timeout ${VT_T:-220} python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_vllm_gpu.py ${EXTRA_TESTS} 2>&1 | tee $OUT/vllm_gpu.log | grep -E "passed|failed|PASS|FAIL|Error|assert|SKIP" | head -30
