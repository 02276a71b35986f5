source .gpu/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 90 python -m pytest -q tests/gpu/test_fused_norm_cuda.py tests/gpu/test_memory_need_cuda.py -p no:cacheprovider -s 2>&1 | grep -E "peak GiB|passed|failed|Error|assert" | head -20
timeout 150 python benchmarks/train_passes.py --micro-batches 16 64 --chunks 440 --no-compile --new-shapes 0 --repeat 3 2>&1 | grep -v Warning | tail -9
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
SHARE=""; [ "$MEM" -lt 100000 ] && SHARE="--vllm-memory 0.15"
echo "share: ${SHARE:-default}"
timeout ${STEP_T:-330} python benchmarks/grpo_step.py --rows ${ROWS:-ray,ray-ownnorm} --steps 6 $SHARE --json $OUT/step.json > $OUT/step.log 2>&1; echo rc=$?
grep -v "^(" $OUT/step.log | grep -E "^\[|^row|^trl|^reroll|Error|^phase|^  " | grep -v "it/s\]" | tail -50
