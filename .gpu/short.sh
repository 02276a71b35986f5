nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p /tmp/small && tar -xJf .devbundle/small/site.tar.xz -C /tmp/small
export PYTHONPATH=/tmp/small:$PWD
timeout 90 python -m pytest -q -p no:cacheprovider tests/gpu/test_packed_attention_cuda.py tests/gpu/test_fsdp2_cuda.py 2>&1 | tail -15
timeout 80 python benchmarks/packing.py --repeat 2 2>&1 | grep -v Warning | tail -6
