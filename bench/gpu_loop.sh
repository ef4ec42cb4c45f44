#!/usr/bin/env bash
# The GPU loop on a 2-GPU H200 machine, with its baselines measured in the same call:
#   1. the standalone learner step on the loop's model (bench/learner_step.py, GPU 0),
#   2. a raw NCCL broadcast of the loop's weights, GPU 0 -> GPU 1 (bench/weight_transfer.py),
#   3. `streamrl run --config examples/gpu.toml` (learner GPU 0, one hf node GPU 1), STEPS steps,
#   4. the run's figures against 1 and 2 (bench/loop_figures.py).
# JSON lines go to $OUT/figures.jsonl; the run's metrics and logs' tails beside it.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; RUNS=/tmp/runs; STEPS=${STEPS:-50}
F="$OUT/figures.jsonl"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())" | tee "$OUT/env.txt"
python3 -m streamrl make-tiny-model models/qwen2-0.5b-shape --shape 0.5b > "$OUT/setup.log" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/learner_step.py --mode streamrl --compile --pad --vocab 512 \
  --longest 176 --budget 40960 --micro-batches 2 --samples 700 --head-logits-gib 24 --steps 6 >> "$F" 2>> "$OUT/errors.txt"
timeout 90 python3 bench/weight_transfer.py --shapes qwen2-0.5b-v512 --bucket-mb 256 --iters 5 >> "$F" 2>> "$OUT/errors.txt"
timeout "${RUN_LIMIT:-360}" python3 -m streamrl run --config examples/gpu.toml --rollout-nodes 1 --steps "$STEPS" \
  --set "run.dir='$RUNS'" > "$OUT/run.txt" 2>&1
echo "run exit $?" >> "$OUT/run.txt"
MFU=$(python3 -c "import json;print([json.loads(l) for l in open('$F') if 'learner_step' in l][-1]['mfu'])" 2>/dev/null || echo 0)
RAW=$(python3 -c "import json;print([json.loads(l) for l in open('$F') if 'weight_transfer' in l][-1]['raw_ms'])" 2>/dev/null || echo 0)
python3 -m streamrl.bench.loop_figures "$RUNS/gpu" --skip 8 --standalone-mfu "$MFU" --raw-broadcast-ms "$RAW" >> "$F"
cp "$RUNS/gpu/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
for f in "$RUNS"/gpu/logs/*.out; do echo "== $f"; tail -c 4000 "$f"; done > "$OUT/logs.txt" 2>/dev/null
# the gpu-marked tests, when the call has time left (SECONDS counts from the script's start)
if [ -n "${TESTS-}" ] && [ "$SECONDS" -lt 450 ]; then
  timeout $((560 - SECONDS)) python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
fi
cat "$F"
