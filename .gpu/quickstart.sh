# The README's quickstart as shipped on the GPU machine (no overrides): placement and engine resolve themselves.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cp .devbundle/vllm/p3/* /tmp/vstage/ && source .gpu/env.sh || exit 3
python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
start=$(date +%s.%N)
timeout ${QS_T:-540} python -m reroll.cli train examples/quickstart/arithmetic_grpo.yaml > $OUT/quickstart.log 2>&1
echo "rc=$? seconds=$(echo "$(date +%s.%N) - $start" | bc)"
grep -E "placement|engine|step +0/|step +200/|done:|error" $OUT/quickstart.log | grep -v Warning | head -20
tail -5 $OUT/quickstart.log
cp runs/quickstart/metrics.jsonl runs/quickstart/config.yaml $OUT/ 2>/dev/null
