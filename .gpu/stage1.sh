# Stage vLLM bundle part 1 (carry .devbundle/vllm/p1)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/vstage && cp .devbundle/vllm/p1/* /tmp/vstage/ && ls /tmp/vstage
