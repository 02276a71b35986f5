source .gpu/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
SHARE=""; [ "$MEM" -lt 100000 ] && SHARE="--vllm-memory 0.15"
nvidia-smi dmon -s pucm -d 1 > $OUT/dmon.log 2>&1 &
DMON=$!
timeout 570 python benchmarks/grpo_step.py --rows $ROWS --steps 6 $SHARE --json $OUT/step.json > $OUT/step.log 2>&1; echo rc=$?
kill $DMON
grep -v "^(" $OUT/step.log | grep -E "^\[|^row|^trl|^reroll|Error" | grep -v "it/s\]" | tail -60
