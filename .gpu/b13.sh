# 3B shape (after b11 on the same machine): TRL with vLLM colocated, then reroll's ray row with activation
# EXTRA: more arguments for grpo_step.py (e.g. --vllm-memory 0.15)
# checkpointing chosen per layer (auto) and the trainer's host buffers prepared ahead (issue 40 items 2, 4).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -d .devbundle/vllm/p3 ] && mkdir -p /tmp/vstage && cp .devbundle/vllm/p3/* /tmp/vstage/  # the last part, before env.sh unpacks
source .gpu/env.sh || exit 3
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
SHARE=""; [ "$MEM" -lt 100000 ] && SHARE="--vllm-memory 0.15"  # as peers.sh: 0.15 on 80 GB cards
nvidia-smi dmon -s pucm -d 1 > $OUT/dmon3b.log 2>&1 &
timeout ${STEP_T:-570} python benchmarks/grpo_step.py --sizes 3b --rows "${ROWS-ray,ray-ckpt}" --peers "${PEERS-trl-vllm}" --steps 5 $SHARE \
  --gradient-checkpointing ${GC:-auto} $EXTRA --peer-timeout ${PEER_T:-260} --json $OUT/b3.json > $OUT/b3.log 2>&1; echo rc=$?
grep -v "^(" $OUT/b3.log | grep -E "^\[|^phase|^[a-z_]+ {3,}|^[a-z]+ (tok/s|MFU)|^row|^fastest|^trl|^verl|^reroll|^GRPO|rror|checkpoint|plan" \
  | grep -v "it/s\]" | tail -70
