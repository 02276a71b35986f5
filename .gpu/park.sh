# One call: stage vLLM part 0, then the pinned offload GPU tests (HostParking, park_storages).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/vstage && cp .devbundle/vllm/p0/* /tmp/vstage/ && ls /tmp/vstage
mkdir -p /tmp/small && tar -xJf .devbundle/small/site.tar.xz -C /tmp/small
PYTHONPATH=/tmp/small:$PWD timeout 120 python -m pytest -q -p no:cacheprovider tests/gpu/test_pinned_offload_cuda.py 2>&1 | tail -15
