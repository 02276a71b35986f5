# After staging p0..p2 (carry .devbundle/vllm/p3 .devbundle/verl.tar.xz): the CUDA tests of what was built
# since the last GPU run, then TRL with vLLM colocated, verl and reroll's ray row in one table.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -f /tmp/site/.unpacked ] || cp .devbundle/vllm/p3/* /tmp/vstage/; source .gpu/env.sh || exit 3
timeout 130 python -m pytest -q -p no:cacheprovider -rs -s tests/gpu/test_fused_head_cuda.py tests/gpu/test_vision_attention_cuda.py tests/gpu/test_pinned_offload_cuda.py tests/gpu/test_host_syncs_cuda.py tests/gpu/test_fsdp2_load_cuda.py 2>&1 | tee $OUT/cuda_tests.log | grep -E "passed|failed|assert|GiB|peak|Error" | head -12
PEERS=${PEERS:-trl-vllm,verl} ROWS=${ROWS:-ray} STEP_T=${STEP_T:-420} PEER_T=${PEER_T:-130} bash .gpu/peers.sh
