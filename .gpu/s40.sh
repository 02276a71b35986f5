# After b13 on the same machine (p0..p3 staged): the sleeping engine's weights-only IPC test (its failure
# printed whole), then verl alone at 0.5B (carry .devbundle/verl.tar.xz). ~450 s.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
source .gpu/env.sh || exit 3
rm -rf /tmp/grpo-bench-* 2>/dev/null
timeout ${TEST_T:-150} python -m pytest -q -p no:cacheprovider --tb=short -k sleeping tests/gpu/test_vllm_gpu.py \
  > $OUT/sleeping.log 2>&1; echo "sleeping test rc=$?"
grep -v -E "^\(|Capturing CUDA|it/s\]" $OUT/sleeping.log | grep -E -A25 "^_{5,}|Error|assert" | head -60
PEERS=verl PEER_T=${PEER_T:-280} STEP_T=${STEP_T:-300} ROWS= bash .gpu/peers.sh
