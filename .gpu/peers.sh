# issue 40: reroll's ray row against the strongest peers in one call (TRL with vLLM colocated; verl where its
# bundle came along), within 560 s. Needs the vLLM bundle staged in /tmp/vstage (p0..p2 by earlier calls);
# carry .devbundle/vllm/p3 (staged here if carried) and, for the verl row, .devbundle/verl.tar.xz.
#   PEERS=trl-vllm,trl-vllm-nois (default; verl needs .devbundle/verl.tar.xz carried; trl: transformers
#   generation)  ROWS=ray (ROWS= : the peers alone)  STEP_T=520  PEER_T=240 (seconds a peer may take)
#   EXTRA: more arguments for grpo_step.py, after the share (EXTRA="--vllm-memory 0.3" overrides it)
[ -d .devbundle/vllm/p3 ] && mkdir -p /tmp/vstage && cp .devbundle/vllm/p3/* /tmp/vstage/
ls /tmp/vstage
source .gpu/env.sh || exit 3
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
# each peer costs ~100-150 s here (an engine start, compilation, 7 steps): three peers and the ray row fill 560 s.
# verl only where asked (PEERS=...,verl): it has not yet run to the end on the GPU machine; its row stops at
# --peer-timeout and says so, and the rows after it still run
if [ -f .devbundle/verl.tar.xz ]; then  # verl and the needs the vLLM bundle lacks, behind /tmp/site
  mkdir -p /tmp/verl && tar -xJf .devbundle/verl.tar.xz -C /tmp/verl && export PYTHONPATH=$PYTHONPATH:/tmp/verl
fi
PEERS=${PEERS:-trl-vllm,trl-vllm-nois}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
SHARE=""; [ "$MEM" -lt 100000 ] && SHARE="--vllm-memory 0.15"  # as the earlier rows had: 0.15 on 80 GB cards
echo "peers: $PEERS; share: ${SHARE:-default 0.35}"
nvidia-smi dmon -s pucm -d 1 > $OUT/dmon.log 2>&1 &
DMON=$!
timeout ${STEP_T:-520} python benchmarks/grpo_step.py --rows "${ROWS-ray}" --peers "${PEERS/none/}" --steps ${STEPS:-6} $SHARE $EXTRA \
  --peer-timeout ${PEER_T:-240} --json $OUT/peers.json > $OUT/peers.log 2>&1; echo rc=$?
kill $DMON
# each row's per-step lines, then the tables (the peers' own logs stay in $OUT/peers.log)
grep -v "^(" $OUT/peers.log | grep -E "^\[|^phase|^[a-z_]+ {3,}|^[a-z]+ (tok/s|MFU)|^row|^fastest|^trl|^verl|^reroll|^GRPO|rror" \
  | grep -v "it/s\]" | tail -80
grep -E "^\(MFU" $OUT/peers.log
