# The multi-GPU acceptance kit (docs/scale.md) on a lent machine of 2, 4 or 8 GPUs, after staging the vLLM
# bundle's p0..p2 (stage0..2.sh, three calls): carry .devbundle/vllm/p3 .devbundle/mcore.tar.xz. Every
# test marked multigpu (tests/multigpu and the Megatron ones in tests/gpu), then the table; the numbers and
# the table come back under $OUT/kit. KIT_ARGS: extra pytest arguments (e.g. -k "fsdp2 or megatron").
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[ -f /tmp/site/.unpacked ] || cp .devbundle/vllm/p3/* /tmp/vstage/; source .gpu/env.sh || exit 3
tar -xJf .devbundle/mcore.tar.xz -C /tmp/site && python -c "import megatron.core as m; print('megatron-core', m.__version__)"
timeout ${KIT_T:-560} python -m tests.multigpu --out $OUT/kit ${KIT_ARGS} > $OUT/kit.log 2>&1; echo rc=$?
grep -E "passed|failed|skipped" $OUT/kit.log | tail -3
cat $OUT/kit/table.txt 2>/dev/null | head -60
