# After staging p0..p2 (carry .devbundle/vllm/p3 .devbundle/verl.tar.xz): the fused head's CUDA test, then
# reroll's ray row against TRL with vLLM and verl in one call.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -f /tmp/site/.unpacked ] || cp .devbundle/vllm/p3/* /tmp/vstage/; source .gpu/env.sh || exit 3
timeout ${FH_T:-60} python -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_fused_head_cuda.py 2>&1 | tee $OUT/fused.log | grep -E "passed|failed|assert|GiB|peak|Error" | head -12
PEERS=${PEERS:-trl-vllm,verl} STEP_T=${STEP_T:-430} PEER_T=${PEER_T:-150} bash .gpu/peers.sh
