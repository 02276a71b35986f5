# Stage vLLM part 3, run the vLLM GPU tests (the 'ipc' sync at world size 1), then the quickstart as shipped.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .devbundle/vllm/p3/* /tmp/vstage/ && source .gpu/env.sh || exit 3
timeout 230 python -m pytest -q -p no:cacheprovider tests/gpu/test_vllm_gpu.py 2>&1 | tail -15
start=$(date +%s.%N)
timeout ${QS_T:-300} python -m reroll.cli train examples/quickstart/arithmetic_grpo.yaml > $OUT/quickstart.log 2>&1
echo "quickstart rc=$? seconds=$(python -c "import time; print(round(time.time() - $start, 1))")"
grep -E "placement|engine|transport|step +0/|step +200/|done:|rror" $OUT/quickstart.log | grep -v Warning | head -20
tail -3 $OUT/quickstart.log
cp runs/quickstart/metrics.jsonl runs/quickstart/config.yaml $OUT/ 2>/dev/null
