# Stage vLLM bundle part 2 (carry .devbundle/vllm/p2)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/vstage && cp .devbundle/vllm/p2/* /tmp/vstage/ && ls /tmp/vstage
