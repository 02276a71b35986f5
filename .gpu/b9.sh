# After staging p0..p2 (carry .devbundle/vllm/p3 .devbundle/verl.tar.xz): the fused head's and the batched
# vision attention's CUDA tests, the vision tower alone (loop vs batched), then reroll's ray row beside verl.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -f /tmp/site/.unpacked ] || cp .devbundle/vllm/p3/* /tmp/vstage/; source .gpu/env.sh || exit 3
timeout 55 python -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_fused_head_cuda.py tests/gpu/test_vision_attention_cuda.py 2>&1 | tee $OUT/cuda_tests.log | grep -E "passed|failed|assert|GiB|peak|Error" | head -12
timeout 35 python benchmarks/vision_attention.py --device cuda --hidden 1280 --heads 16 --depth 32 --intermediate 3420 --images 16 2>&1 | tee $OUT/vattn.log | grep -v Warn | tail -8
PEERS=${PEERS:-verl} ROWS=ray STEP_T=${STEP_T:-195} PEER_T=${PEER_T:-95} bash .gpu/peers.sh
