#!/usr/bin/env bash
# One device call for both GPU figures, most important first, each part bounded so the call ends in time:
#   1. the standalone learner step on the loop's model (GPU 0)       -> in-loop MFU / standalone, same call
#   2. `streamrl run --config examples/gpu.toml`, STEPS steps          -> the GPU loop's figures
#   3. `bench/pipeline.py --config examples/gpu.toml`, sync vs async   -> async gain as a fraction of ideal
# RAW_MS: a raw NCCL broadcast of the loop's weights measured in an earlier call (bench/weight_transfer.py).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; RUNS=/tmp/runs; F="$OUT/figures.jsonl"
python3 -m streamrl make-tiny-model models/qwen2-0.5b-shape --shape 0.5b > /tmp/setup.log 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 75 python3 bench/learner_step.py --mode streamrl --compile --pad --vocab 512 \
  --longest 176 --budget 40960 --micro-batches 2 --samples 700 --head-logits-gib 24 --warmup 1 --steps 4 \
  >> "$F" 2>> "$OUT/errors.txt"
timeout "${RUN_LIMIT:-240}" python3 -m streamrl run --config examples/gpu.toml --rollout-nodes 1 \
  --steps "${STEPS:-50}" --set "run.dir='$RUNS'" > "$OUT/run.txt" 2>&1; echo "run exit $?" >> "$OUT/run.txt"
MFU=$(python3 -c "import json;print([json.loads(l) for l in open('$F') if 'learner_step' in l][-1]['mfu'])" 2>/dev/null || echo 0)
python3 -m streamrl.bench.loop_figures "$RUNS/gpu" --skip 8 --standalone-mfu "$MFU" --raw-broadcast-ms "${RAW_MS:-0}" >> "$F"
cp "$RUNS/gpu/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
for f in "$RUNS"/gpu/logs/*.out; do echo "== $f"; tail -c 3000 "$f"; done > "$OUT/logs.txt" 2>/dev/null
cat "$F"
timeout "${PIPE_LIMIT:-170}" python3 -m streamrl.bench.pipeline --config examples/gpu.toml --staleness 1 \
  --steps "${PIPE_STEPS:-8}" --out "$OUT" >> "$F" 2>> "$OUT/errors.txt"
tail -n 3 "$F"
