# No vLLM (carry .devbundle/site.tar.xz .devbundle/mcore.tar.xz, one call): Megatron-Core on one GPU, which
# has not run since TP=1 on 2026-12-06 (sequence-parallel norms, the layout-free optimizer state, the 1F1B
# schedule and per-rank checkpoint reads came after), then the residency check at 3B (no engine: the unit
# arithmetic only). The multigpu ones skip on one GPU.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/site && tar -xJf .devbundle/site.tar.xz -C /tmp/site && tar -xJf .devbundle/mcore.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python -c "import megatron.core as m; print('megatron-core', m.__version__)" || exit 3
timeout ${MG_T:-420} python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_megatron.py tests/gpu/test_megatron_resume_gpu.py 2>&1 | tee $OUT/megatron.log | grep -E "passed|failed|PASS|FAIL|Error|assert|SKIP|tolerance|loss" | head -40
