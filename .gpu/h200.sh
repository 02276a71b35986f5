# The measurement: GPU tests, then TRL + ray + ray-dp2 in one call (share auto: 0.15 on <100 GB cards)
source .gpu/env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 120 python -m pytest -q tests/gpu/test_memory_need_cuda.py ${GPU_TESTS:-tests/gpu/test_fused_norm_cuda.py} -p no:cacheprovider 2>&1 | grep -E "passed|failed|assert" | head
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
SHARE=""; [ "$MEM" -lt 100000 ] && SHARE="--vllm-memory 0.15"
echo "share: ${SHARE:-default}"
nvidia-smi dmon -s pucm -d 1 > $OUT/dmon.log 2>&1 &
DMON=$!
timeout ${STEP_T:-420} python benchmarks/grpo_step.py --rows ${ROWS:-ray,ray-dp2} --steps 6 $SHARE --json $OUT/step.json > $OUT/step.log 2>&1; echo rc=$?
kill $DMON
grep -v "^(" $OUT/step.log | grep -E "^\[|^phase|^[a-z_]+ {3,}|^row|^trl|^reroll|rror" | grep -v "it/s\]" | tail -60
