# Megatron-Core's one-GPU tests (megatron-core was never in the GPU bundle: it has not run on a GPU since
# 2026-12-06) with the small bundle (pydantic, ray, peft, pytest, megatron-core 0.16.1), no vLLM staging:
# carry .devbundle/small. For a session with ~4 minutes of device time. The multi-GPU tests skip.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/small && tar -xJf .devbundle/small/site.tar.xz -C /tmp/small
export PYTHONPATH=/tmp/small:$PWD PYTHONUNBUFFERED=1
python -c "import megatron.core as m, pydantic, ray; print('megatron-core', m.__version__)" || exit 3
timeout ${T:-200} python -m pytest -v -p no:cacheprovider -rs --tb=short --durations=8 tests/gpu/test_megatron.py \
  tests/gpu/test_megatron_resume_gpu.py > $OUT/mcore.log 2>&1; echo "rc=$?"
grep -E " PASSED| FAILED| ERROR|passed|failed|^SKIPPED" $OUT/mcore.log | cut -c1-200 | head -60
grep -E -B2 -A18 "^_{5,}" $OUT/mcore.log | head -80
