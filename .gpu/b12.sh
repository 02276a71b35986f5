# After b11 on the same machine (the vLLM bundle in /tmp/site): training/reference passes at 64/128/256 rows
# (fused head vs logits), engines per GPU (ray-dp2, ray-dp4), then the VL-3B step (batched vision attention).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
source .gpu/env.sh || exit 3
timeout ${TP_T:-100} python benchmarks/train_passes.py --no-compile --micro-batches 64 --chunks 1760 --new-shapes 0 --repeat 2 2>&1 | tee $OUT/passes.log | grep -v Warn | tail -16
PEERS=none ROWS=${ROWS:-ray-dp2,ray-dp4} STEP_T=${STEP_T:-260} bash .gpu/peers.sh
timeout ${VL_T:-170} python benchmarks/vision_step.py --steps 3 --json $OUT/vision.json > $OUT/vision.log 2>&1; echo vision rc=$?
grep -vE "Warn|it/s\]" $OUT/vision.log | grep -E "^\[|step|phase|generate|train|reference|sync|tok|GPU|rror" | tail -25
