# No vLLM needed (carry .devbundle/site.tar.xz .devbundle/mcore.tar.xz, one call): Megatron-Core on one GPU,
# which has not run since TP=1 on 2026-12-06 (sequence-parallel norms, the layout-free optimizer state, the
# 1F1B schedule and per-rank checkpoint reads came after). The multigpu ones skip on one GPU. Where the vLLM
# bundle is already unpacked in /tmp/site (an earlier call on this machine), megatron-core goes beside it;
# else ray + pydantic + megatron-core go in /tmp/msite.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -f /tmp/site/.unpacked ]; then S=/tmp/site; else S=/tmp/msite; mkdir -p $S && tar -xJf .devbundle/site.tar.xz -C $S; fi
tar -xJf .devbundle/mcore.tar.xz -C $S
export PYTHONPATH=$S:$PWD PYTHONUNBUFFERED=1
python -c "import megatron.core as m; print('megatron-core', m.__version__)" || exit 3
timeout ${MG_T:-420} python -m pytest -q -p no:cacheprovider -rs tests/gpu/test_megatron.py tests/gpu/test_megatron_resume_gpu.py 2>&1 | tee $OUT/megatron.log | grep -E "passed|failed|PASS|FAIL|Error|assert|SKIP|tolerance|loss" | head -40
