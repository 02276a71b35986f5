# The vLLM bundle, unpacked once into /tmp/site from its four staged parts (stage0..2.sh, then p3 carried):
# refused while a part is missing, and an unpacking cut short is removed (a half-written /tmp/site is never
# trusted by a later call: /tmp/site/.unpacked marks a whole one).
if [ ! -f /tmp/site/.unpacked ]; then
  for p in 0 1 2 3; do
    [ -f /tmp/vstage/part$p ] || { echo "vLLM bundle: part$p is not staged (stage0..2.sh; part3: carry .devbundle/vllm/p3)"; exit 3; }
  done
  rm -rf /tmp/site && mkdir -p /tmp/site
  if (set -o pipefail; cat /tmp/vstage/part0 /tmp/vstage/part1 /tmp/vstage/part2 /tmp/vstage/part3 | xz -dc -T0 | tar -x -C /tmp/site); then
    touch /tmp/site/.unpacked
  else
    rm -rf /tmp/site; echo "vLLM bundle: unpacking failed (a part cut short?): stage the parts again"; exit 3
  fi
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
