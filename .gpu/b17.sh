# 7B LoRA row against TRL with vLLM in the same call (issue 40 item 5), after p0..p2 are staged: carry
# EXTRA: more arguments for grpo_step.py (e.g. --vllm-memory 0.15)
# .devbundle/vllm/p3. ROWS/PEERS/TUNE/STEP_T/PEER_T as in peers.sh, GC as in b13.sh; the model build takes ~1-2 minutes.
[ -d .devbundle/vllm/p3 ] && mkdir -p /tmp/vstage && cp .devbundle/vllm/p3/* /tmp/vstage/
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
source .gpu/env.sh || exit 3
[ -n "$TESTS" ] && timeout 120 python -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -5  # e.g. TESTS=tests/gpu/test_lora_export_cuda.py
nvidia-smi dmon -s pucm -d 2 > $OUT/dmon7b.log 2>&1 &
timeout ${STEP_T:-570} python benchmarks/grpo_step.py --sizes 7b --tune ${TUNE:-lora} --peers "${PEERS-trl-vllm}" \
  --rows "${ROWS-ray}" --steps ${STEPS:-3} ${GC:+--gradient-checkpointing $GC} --warmup 1 --micro-batch 16 --logprob-micro-batch 16 $EXTRA \
  --peer-timeout ${PEER_T:-270} --json $OUT/b7.json > $OUT/b7.log 2>&1; echo rc=$?
grep -v "^(" $OUT/b7.log | grep -E "^\[|^phase|^[a-z_]+ {3,}|^[a-z]+ (tok/s|MFU)|^row|^fastest|^trl|^reroll|^GRPO|rror|plan" \
  | grep -v "it/s\]" | tail -60
