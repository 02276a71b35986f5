# The colocated vLLM quickstart (test_vllm_gpu's 40 steps) with the engine's log-probs on, once per transport,
# metrics to $OUT: does the engine hold the trainer's weights after each sync (mismatch/*)?
[ -f /tmp/site/.unpacked ] || cp .devbundle/vllm/p3/* /tmp/vstage/; source .gpu/env.sh || exit 3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in ipc object_store; do
  d=/tmp/diag-$t; A=$d/assets
  timeout 150 python -m reroll.cli train examples/quickstart/arithmetic_grpo.yaml "output_dir=$d/{name}" \
    model.path=$A/tiny-arithmetic "data.train_files=[$A/arithmetic/train.jsonl]" "data.eval_files=[$A/arithmetic/test.jsonl]" \
    total_steps=40 eval.every=0 checkpoint.every=0 placement.devices=1 placement.device_type=cuda rollout.engine=vllm \
    rollout.vllm.gpu_memory_utilization=0.3 rollout.vllm.enforce_eager=false rollout.vllm.max_model_len=64 \
    model.dtype=bfloat16 strategy.name=fsdp2 rollout.logprobs=true rollout.weight_sync_transport=$t > $OUT/$t.log 2>&1
  echo "$t rc=$?"; cp $d/quickstart/metrics.jsonl $OUT/$t.metrics.jsonl
  grep -E "transport|weight sync|step +(0|1|2|20|39|40)/|done" $OUT/$t.log | grep -v Warning | head -12
  python - $OUT/$t.metrics.jsonl <<'P'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = sorted({k for r in rows for k in r if k.startswith("mismatch/")})[:4]
for r in rows[:4] + rows[-3:]:
    print(r.get("step"), {k: round(r[k], 4) for k in keys if k in r}, "acc", r.get("eval/accuracy"), "rew", round(r.get("rollout/reward_mean", 0), 3), "bytes", r.get("sync/bytes"))
P
done
