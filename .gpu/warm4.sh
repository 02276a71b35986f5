# On a machine another call left warm with the vLLM bundle staged (or stage part 3 if parts 0-2 are there):
# Megatron's GPU tests, then the vLLM GPU tests (carry .devbundle/vllm/p3 .devbundle/mcore.tar.xz)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ls /tmp/vstage /tmp/site 2>&1 | head -5
[ -f /tmp/site/.unpacked ] || cp .devbundle/vllm/p3/* /tmp/vstage/
source .gpu/env.sh || exit 3
python -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
bash .gpu/b4.sh
