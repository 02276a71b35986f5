# A small Qwen3-MoE and a Qwen2.5-VL-3B-shaped policy through the Ray path with vLLM (after staging).
source .gpu/env.sh || exit 3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${MOE_T:-240} python benchmarks/grpo_step.py --sizes moe --rows ray --skip-trl --steps 4 --vllm-memory 0.3 --json $OUT/moe.json > $OUT/moe.log 2>&1; echo moe rc=$?
grep -v "^(" $OUT/moe.log | grep -E "^\[|^phase|^[a-z_]+ {3,}|^row|^reroll|rror|GRPO step" | grep -v "it/s\]" | tail -30
timeout ${VL_T:-290} python benchmarks/vision_step.py --steps 3 --json $OUT/vision.json > $OUT/vision.log 2>&1; echo vision rc=$?
grep -v "^(" $OUT/vision.log | grep -E "^\[|^phase|^[a-z_]+ {3,}|^s/step|rror|GRPO step" | grep -v "it/s\]" | tail -30
