# After staging p0..p2: stage p3 (carry .devbundle/vllm/p3), the Qwen2.5-VL-3B-shaped GRPO run (issue 38 item 7),
# then the vLLM learning test at 100 steps and the engine-recovery test (vllm variant).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -f /tmp/site/.unpacked ] || cp .devbundle/vllm/p3/* /tmp/vstage/; source .gpu/env.sh || exit 3
python -c "import torchvision, vllm; print('torchvision', torchvision.__version__, 'vllm', vllm.__version__)" 2>&1 | tail -1
timeout ${VL_T:-270} python benchmarks/vision_step.py --steps 4 --json $OUT/vision.json > $OUT/vision.log 2>&1; echo vision rc=$?
grep -v "^(" $OUT/vision.log | grep -E "^\[|^phase|^[a-z_]+ {3,}|^s/step|rror|GRPO step|tok/s" | grep -v "it/s\]" | tail -30
timeout ${LT_T:-170} python -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_vllm_gpu.py -k learn 2>&1 | tee $OUT/learn.log | grep -E "passed|failed|assert|reward|held-out|accuracy" | head -20
timeout ${RC_T:-110} python -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_engine_recovery_gpu.py -k vllm 2>&1 | tee $OUT/recovery.log | grep -E "passed|failed|Error|assert|SKIP|recreated|step" | head -20
