source .gpu/env.sh
timeout 570 python benchmarks/grpo_step.py --rows ray,ray-resident --steps 6 --json $OUT/step.json > $OUT/step.log 2>&1; echo rc=$?
grep -v "^(" $OUT/step.log | tail -60
