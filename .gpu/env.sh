[ -d /tmp/site/vllm ] || { mkdir -p /tmp/site && cat /tmp/vstage/part* | xz -dc -T0 | tar -x -C /tmp/site; } || exit 3
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
