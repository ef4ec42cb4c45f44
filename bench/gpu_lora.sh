#!/usr/bin/env bash
# LoRA on one H200 (issue 29), in one device call; JSON lines to $OUT/figures.jsonl, logs beside it.
#   push:  bench/weight_transfer.py on the 0.5B shape (152k vocabulary), CUDA IPC on one GPU: the full push
#          and an adapter push (rank 16 on every linear layer), bytes, the learner's hold and the node's copy
#   step:  the 7B shape (152k vocabulary), LoRA r16 on every linear layer, 8 x 1024 tokens a step: HF + PEFT
#          eager (the reference learner) vs streamrl's learner (packed, compiled, FSDP2), tokens/s, MFU
#          (4 x frozen + 6 x adapter parameters per token), peak memory
#   loop:  `streamrl run` on a 7B-shaped random model (512-token vocabulary) with [lora], the hf node on the
#          learner's GPU (adapters by CUDA IPC), STEPS steps; both roles' peak memory from nvidia-smi
# PARTS="loop" runs the loop alone. Carry the wheels of ../shared/tools/gpu-wheels.sh plus peft and tomli_w
# (`streamrl run` writes its config.toml with it; the lent machine lacks it). Figures: bench/RESULTS.md, "LoRA".
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; F="$OUT/figures.jsonl"; RUNS=/tmp/runs; M=/tmp/models/qwen2-7b-shape
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
# the loop's model, written meanwhile (bf16, initialised on the GPU: seconds, not minutes)
(timeout 120 python3 -m streamrl make-tiny-model $M --shape 7b --dtype bfloat16 --device cuda > "$OUT/model.txt" 2>&1) &
MODEL_PID=$!

if [[ "${PARTS:-push step loop}" == *step* ]]; then
for lora in 0 16; do
  timeout 55 python3 bench/weight_transfer.py --paths shared --receiver-device cuda:0 --shapes qwen2-0.5b \
    --bucket-mb 256 --warmup 2 --iters 10 --lora $lora >> "$F" 2>> "$OUT/errors.txt"
done
tail -n 2 "$F"
wait $MODEL_PID
timeout 90 python3 bench/learner_step.py --mode baseline --shape 7b --lora 16 --batch 8 --seq 1024 --warmup 1 \
  --steps 3 >> "$F" 2>> "$OUT/errors.txt"
timeout 140 python3 bench/learner_step.py --mode streamrl --shape 7b --lora 16 --compile --budget 8192 \
  --micro-batches 1 --longest 1024 --samples 32 --warmup 2 --steps 3 >> "$F" 2>> "$OUT/errors.txt"
tail -n 2 "$F"
fi
wait $MODEL_PID

nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -lms 500 > "$OUT/smi.txt" 2>&1 &
SMI=$!
(sleep 120; ps -eo pid,args | grep -E "streamrl (learner|rollout)" > "$OUT/ps.txt") &
timeout "${RUN_LIMIT:-190}" python3 -m streamrl run --config examples/gpu.toml --rollout-nodes 1 --steps "${STEPS:-10}" \
  --set "run.dir='$RUNS'" --set "run.name='lora7b'" --set "model.path='$M'" --set lora.enabled=true \
  --set lora.rank=16 --set learner.lr=1e-4 --set learner.groups_per_step=8 --set learner.micro_batch_tokens=8192 \
  --set rollout.max_concurrent_groups=8 --set rollout.max_tokens=64 --set learner.head_logits_gib=4.0 \
  > "$OUT/run.txt" 2>&1; echo "run exit $?" >> "$OUT/run.txt"
kill $SMI
python3 -m streamrl status --run lora7b --runs-dir "$RUNS" > "$OUT/status.txt" 2>&1
python3 -m streamrl.bench.loop_figures "$RUNS/lora7b" --skip 3 >> "$F" 2>> "$OUT/errors.txt"
python3 - "$OUT/smi.txt" >> "$F" <<'PY'
import collections, json, sys
peak = collections.defaultdict(int)  # pid -> MiB, the largest nvidia-smi saw
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 3 and parts[2].endswith("MiB"):
        peak[f"{parts[0]} {parts[1]}"] = max(peak[f"{parts[0]} {parts[1]}"], int(parts[2].split()[0]))
print(json.dumps({"figure": "loop_peak_memory_mib", **peak}))
PY
cp "$RUNS/lora7b/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
for f in "$RUNS"/lora7b/logs/*.out "$RUNS"/lora7b/logs/*.log; do echo "== $f"; tail -c 2500 "$f"; done > "$OUT/logs.txt" 2>/dev/null
tail -n 4 "$F"; tail -n 20 "$OUT/run.txt"; tail -n 4 "$OUT/status.txt"; tail -c 1500 "$OUT/errors.txt"
