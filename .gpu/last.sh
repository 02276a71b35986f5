# Last call: stage vLLM part 3, then the measurement (TRL + the ray rows) through h200.sh.
mkdir -p /tmp/vstage && cp .devbundle/vllm/p3/* /tmp/vstage/ && ls /tmp/vstage
GPU_TESTS=${GPU_TESTS:-tests/gpu/test_fused_norm_cuda.py} bash .gpu/h200.sh
