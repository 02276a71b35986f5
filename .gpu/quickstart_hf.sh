# The README's quickstart as shipped on the GPU machine, without vLLM (rollout.engine auto -> hf): placement resolves itself.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/site && tar -xJf .devbundle/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
start=$(date +%s.%N)
timeout ${QS_T:-500} python -m reroll.cli train examples/quickstart/arithmetic_grpo.yaml > $OUT/quickstart.log 2>&1
echo "rc=$? seconds=$(python -c "import time; print(round(time.time() - $start, 1))")"
grep -E "placement|engine|step +0/|step +200/|done:|rror" $OUT/quickstart.log | grep -v Warning | head -20
tail -4 $OUT/quickstart.log
cp runs/quickstart/metrics.jsonl runs/quickstart/config.yaml $OUT/ 2>/dev/null
