# Stage vLLM bundle part 0 (carry .devbundle/vllm/p0)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/vstage && cp .devbundle/vllm/p0/* /tmp/vstage/ && ls /tmp/vstage
