source .gpu/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 330 python benchmarks/grpo_step.py --rows ray --skip-trl --steps 5 --vllm-memory 0.2 --json $OUT/awake.json > $OUT/awake.log 2>&1; echo rc=$?
grep -E "^\[reroll|Error" $OUT/awake.log | tail -20
