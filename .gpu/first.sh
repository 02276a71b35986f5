# First call of a machine: stage vLLM part 0, then the strategy/packing GPU tests with the small bundle (pydantic).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/vstage && cp .devbundle/vllm/p0/* /tmp/vstage/ && ls /tmp/vstage
mkdir -p /tmp/small && tar -xJf .devbundle/small/site.tar.xz -C /tmp/small
PYTHONPATH=/tmp/small:$PWD timeout 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_packed_attention_cuda.py \
  tests/gpu/test_fsdp2_cuda.py tests/gpu/test_pinned_offload_cuda.py tests/gpu/test_memory_need_cuda.py 2>&1 | tail -40
