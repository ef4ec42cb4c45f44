#!/usr/bin/env bash
# The GPU figures, in parts, each bounded so a device call ends in time (PARTS="loop pipeline" by default;
# add "tests" for the gpu-marked tests). JSON lines go to $OUT/figures.jsonl, logs' tails beside it.
#   loop:     a raw NCCL broadcast of the loop's weights (bench/weight_transfer.py, GPU 0 -> GPU 1),
#             the standalone learner step on the loop's model (GPU 0), then
#             `streamrl run --config examples/gpu.toml`, STEPS steps    -> in-loop MFU / standalone and
#             the push's hold / raw broadcast, all measured in this call
#   pipeline: `bench/pipeline.py` on examples/gpu.toml with long prompts (LONG_WORDS words) and short
#             completions (LONG_TOKENS), so generating and training a step take comparable time:
#             sync vs async at STALENESS                                -> async gain as a fraction of ideal
# One GPU (nvidia-h200; the learner and the node share it, weights by CUDA IPC): PARTS="ipc standalone one modes"
#   ipc:      tests/gpu/test_weights_ipc_gpu.py; bench/weight_transfer.py --paths shared on one GPU (the
#             node's copy out of the learner's buffers, the packing, a plain copy_ of the same bytes); and
#             on this machine's CPUs shared memory vs gloo                -> node copy / copy_, shm / gloo
#   standalone: the learner step alone on the GPU (bench/learner_step.py) -> the MFU the loop is held to
#   one:      the README's one-GPU command for STEPS steps, its books (`streamrl status`) and its figures
#             (with `standalone` before it in the same call: the MFU ratio) -> push blocking / copy_
#   modes:    `pipeline` as above on one GPU: sync vs async at STALENESS -> async / sync, idle fractions
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; RUNS=/tmp/runs; F="$OUT/figures.jsonl"
python3 -m streamrl make-tiny-model models/qwen2-0.5b-shape --shape 0.5b > /tmp/setup.log 2>&1

if [[ " ${PARTS:-loop pipeline} " == *" loop "* ]]; then
  timeout 90 python3 bench/weight_transfer.py --shapes qwen2-0.5b-v512 --bucket-mb 256 --iters 10 \
    >> "$F" 2>> "$OUT/errors.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 75 python3 bench/learner_step.py --mode streamrl --compile --pad --vocab 512 \
    --longest 176 --budget 40960 --micro-batches 2 --samples 700 --head-logits-gib 24 --warmup 1 --steps 4 \
    >> "$F" 2>> "$OUT/errors.txt"
  timeout "${RUN_LIMIT:-240}" python3 -m streamrl run --config examples/gpu.toml --rollout-nodes 1 \
    --steps "${STEPS:-50}" --set "run.dir='$RUNS'" > "$OUT/run.txt" 2>&1; echo "run exit $?" >> "$OUT/run.txt"
  last() { python3 -c "import json;print([r for r in map(json.loads, open('$F')) if r['figure'].startswith('$1')][-1]['$2'])" 2>/dev/null || echo 0; }
  MFU=$(last learner_step mfu); RAW=$(last weight_transfer raw_ms)
  python3 -m streamrl.bench.loop_figures "$RUNS/gpu" --skip 8 --standalone-mfu "$MFU" --raw-broadcast-ms "$RAW" >> "$F"
  cp "$RUNS/gpu/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
  for f in "$RUNS"/gpu/logs/*.out; do echo "== $f"; tail -c 3000 "$f"; done > "$OUT/logs.txt" 2>/dev/null
  cat "$F"
fi

pick() {  # pick FIGURE FIELD [KEY=VALUE ...]: FIELD of the last line of FIGURE matching, else 0
  python3 - "$F" "$@" <<'PY'
import json, sys
path, figure, field, *conds = sys.argv[1:]
want = dict(c.split("=", 1) for c in conds)
rows = [r for r in map(json.loads, open(path)) if r.get("figure", "").startswith(figure)
        and all(str(r.get(k)) == v for k, v in want.items())]
print(rows[-1][field] if rows else 0)
PY
}

if [[ " ${PARTS:-loop pipeline} " == *" ipc "* ]]; then
  timeout "${TESTS_LIMIT:-120}" python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_weights_ipc_gpu.py \
    > "$OUT/ipc_tests.txt" 2>&1; tail -4 "$OUT/ipc_tests.txt"
  timeout 120 python3 bench/weight_transfer.py --paths shared --receiver-device cuda:0 \
    --shapes qwen2-0.5b-v512 qwen2-0.5b --bucket-mb 256 --iters 10 >> "$F" 2>> "$OUT/errors.txt"
  timeout 90 python3 bench/weight_transfer.py --device cpu --paths collective shared --shapes qwen2-0.5b-v512 \
    --bucket-mb 256 --warmup 1 --iters 3 >> "$F" 2>> "$OUT/errors.txt"
  tail -n 5 "$F"
fi

if [[ " ${PARTS:-loop pipeline} " == *" standalone "* ]]; then  # the learner step alone on the GPU
  timeout 75 python3 bench/learner_step.py --mode streamrl --compile --pad --vocab 512 \
    --longest 176 --budget 40960 --micro-batches 2 --samples 700 --head-logits-gib 24 --warmup 1 --steps 4 \
    >> "$F" 2>> "$OUT/errors.txt"
  tail -n 1 "$F"
fi

if [[ " ${PARTS:-loop pipeline} " == *" one "* ]]; then
  timeout "${RUN_LIMIT:-300}" python3 -m streamrl run --config examples/gpu.toml --rollout-nodes 1 \
    --steps "${STEPS:-50}" --set "run.dir='$RUNS'" > "$OUT/run.txt" 2>&1; echo "run exit $?" >> "$OUT/run.txt"
  python3 -m streamrl status --run gpu --runs-dir "$RUNS" > "$OUT/status.txt" 2>&1; echo "status exit $?" >> "$OUT/status.txt"
  COPY=$(pick weight_transfer_shared raw_copy_ms path=cuda_ipc shape=qwen2-0.5b-v512)
  python3 -m streamrl.bench.loop_figures "$RUNS/gpu" --skip 8 --standalone-mfu "$(pick learner_step mfu)" \
    --raw-copy-ms "$COPY" >> "$F"
  cp "$RUNS/gpu/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
  for f in "$RUNS"/gpu/logs/*.out "$RUNS"/gpu/logs/*.log; do echo "== $f"; tail -c 2500 "$f"; done > "$OUT/logs.txt" 2>/dev/null
  tail -n 2 "$F"; tail -n 25 "$OUT/run.txt"; tail -n 3 "$OUT/status.txt"
fi

if [[ " ${PARTS:-loop pipeline} " == *" pipeline "* || " ${PARTS:-} " == *" modes "* ]]; then
  WORDS=${LONG_WORDS:-380}
  python3 -c "import json,random; from streamrl.rewards.demo import DEMO_WORDS as W; r=random.Random(0)
for _ in range(4096): print(json.dumps({'prompt': ' '.join(r.choice(W) for _ in range($WORDS)), 'answer': 'a'}))" \
    > /tmp/long_prompts.jsonl
  timeout -s INT -k 30 "${PIPE_LIMIT:-400}" python3 -m streamrl.bench.pipeline --config examples/gpu.toml \
    --staleness ${STALENESS:-1 2} --steps "${PIPE_STEPS:-10}" --warmup-steps "${PIPE_WARMUP:-2}" \
    --out "$OUT" --dir /tmp/pipe_runs \
    --set "data.path='/tmp/long_prompts.jsonl'" --set "data.max_prompt_tokens=$((WORDS + 4))" \
    --set "rollout.max_tokens=${LONG_TOKENS:-48}" >> "$F" 2>> "$OUT/errors.txt"
  for f in /tmp/pipe_runs/*/logs/*.out; do echo "== $f"; tail -c 2500 "$f"; done > "$OUT/pipe_logs.txt" 2>/dev/null
  tail -n 6 "$F"
fi

if [[ " ${PARTS:-loop pipeline} " == *" tests "* ]]; then
  timeout "${TESTS_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
fi
