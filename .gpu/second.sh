# Second call: stage vLLM part 1, then the packing benchmark (mixed lengths, then uniform).
mkdir -p /tmp/vstage && cp .devbundle/vllm/p1/* /tmp/vstage/ && ls /tmp/vstage
[ -d /tmp/small/pydantic ] || { mkdir -p /tmp/small && tar -xJf .devbundle/small/site.tar.xz -C /tmp/small; }
export PYTHONPATH=/tmp/small:$PWD
timeout 200 python benchmarks/packing.py 2>&1 | grep -v Warning | tail -6
timeout 150 python benchmarks/packing.py --uniform 2>&1 | grep -v Warning | tail -6
