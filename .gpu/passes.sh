source .gpu/env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 250 python benchmarks/train_passes.py --micro-batches 64 --chunks 440 --no-compile --new-shapes 0 --repeat 3 2>&1 | tail -40 | tee $OUT/passes.log
timeout 300 python benchmarks/vllm_outputs.py --rounds 2 --profile 45 > $OUT/vllm_outputs.log 2>&1; echo rc=$?
grep -A8 "^| log-probs" $OUT/vllm_outputs.log; grep -m1 "cProfile:" $OUT/vllm_outputs.log
