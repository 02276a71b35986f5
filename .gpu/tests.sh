# Strategy/packing GPU tests and the packing benchmark with the small bundle (pydantic); no vLLM.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/small && tar -xJf .devbundle/small/site.tar.xz -C /tmp/small
export PYTHONPATH=/tmp/small:$PWD
timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_packed_attention_cuda.py \
  tests/gpu/test_fsdp2_cuda.py tests/gpu/test_pinned_offload_cuda.py tests/gpu/test_memory_need_cuda.py 2>&1 | tail -30
timeout 150 python benchmarks/packing.py 2>&1 | grep -v Warning | tail -6
timeout 120 python benchmarks/packing.py --uniform 2>&1 | grep -v Warning | tail -5
