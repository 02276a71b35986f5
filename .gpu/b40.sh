# Issue 40 in one call, for a session with little device time left (after stage0..2.sh; carry .devbundle/vllm/p3):
# the 3B shape with two engines against TRL with vLLM, then the 0.5B shape with four (and three) engines against
# TRL with vLLM, each size's peer in the same call. T3B: seconds the 3B part may take; the 0.5B part gets the rest
# of TOTAL. ~520 s by the earlier calls' timings (3B: TRL ~160 s, the row ~150 s; 0.5B: TRL ~100 s, a row ~80 s).
# PARTS=3b or PARTS=05: one size alone (less device time left).
[ -d .devbundle/vllm/p3 ] && mkdir -p /tmp/vstage && cp .devbundle/vllm/p3/* /tmp/vstage/
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
source .gpu/env.sh || exit 3
START=$SECONDS
show() { grep -v "^(" $1 | grep -E "^\[|^phase|^[a-z_]+ {3,}|^[a-z]+ (tok/s|MFU)|^row|^fastest|^trl|^reroll|^GRPO|rror|plan" \
  | grep -v "it/s\]" | tail -${2:-60}; }
[[ ${PARTS:-3b,05} == *3b* ]] && timeout ${T3B:-340} python benchmarks/grpo_step.py --sizes 3b --rows "${ROWS3B-ray-mb16-dp2-compile}" --peers trl-vllm \
  --steps ${STEPS3B:-4} --vllm-memory 0.25 --gradient-checkpointing auto --peer-timeout 220 --json $OUT/b3.json \
  > $OUT/b3.log 2>&1; echo "3B rc=$? after $((SECONDS-START)) s"
[ -f $OUT/b3.log ] && show $OUT/b3.log 45
LEFT=$(( ${TOTAL:-575} - (SECONDS-START) ))
echo "0.5B part: $LEFT s"
[[ ${PARTS:-3b,05} == *05* ]] && timeout $LEFT python benchmarks/grpo_step.py --rows "${ROWS05-ray-dp4-compile,ray-dp3-compile}" --peers trl-vllm --steps 5 \
  --vllm-memory 0.3 --peer-timeout 150 --json $OUT/b05.json > $OUT/b05.log 2>&1; echo "0.5B rc=$? after $((SECONDS-START)) s"
[ -f $OUT/b05.log ] && show $OUT/b05.log 60
