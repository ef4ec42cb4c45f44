#!/usr/bin/env bash
# vLLM on one GPU (issue 34): its tests, the rollout bench, the one-GPU loop with vLLM and with hf. Run on the
# device machine from the repo root after vLLM is installed there (../shared/tools/vllm-gpu-parts.sh and
# `source .vp-setup/vllm-setup.sh`) and streamrl is importable (/tmp/site/streamrl). PARTS picks:
#   tests:  tests/gpu/test_weights_ipc_gpu.py (nodes killed mid-copy), test_vllm_gpu.py -> $OUT/vllm_tests.txt
#   bench:  bench/rollout_throughput.py on examples/gpu.toml at SHAPES    -> vllm_node lines in $OUT/figures.jsonl
#           (ROUNDS timed rounds: one is too noisy for a ratio; the node in each rollout.kv_at_swap of KV_MODES
#           too; DELTAS=1: raw and the node with outputs per step too; BETWEEN=1: the node with no push in flight
#           too; each swap's phases in $OUT/bench-SHAPE.txt)
#   loop:   the README's one-GPU command, STEPS steps, vLLM then hf (RUN_LIMIT_vllm, RUN_LIMIT_hf seconds),
#           each run's books and loop figures
#   cost:   (not in the default) bench/vllm_host_cost.py at COST_SHAPE (0.5b): raw AsyncLLM with one thing changed per
#           variant, then two engines on the one GPU; under py-spy where it is installed ($OUT/prof-cost.txt.gz)
#   learn:  (not in the default) the same command on each reward of TASKS ("copy"), STEPS steps: whether the model
#           still learns at the end (the loop line's reward_mid5, reward_last5, reward_slope_second_half,
#           no_gradient_share; issue 35's GPU example)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; RUNS=/tmp/runs; F="$OUT/figures.jsonl"
has() { [[ " ${PARTS:-tests bench loop} " == *" $1 "* ]]; }

if has cost; then
  prof=(); command -v py-spy > /dev/null && prof=(py-spy record --subprocesses --format raw -r 50 -o "$OUT/prof-cost.txt" --)
  timeout "${COST_LIMIT:-200}" "${prof[@]}" python3 -m streamrl.bench.vllm_host_cost --config examples/gpu.toml \
    --shape "${COST_SHAPE:-0.5b}" --variants base nolp final half > "$OUT/cost.txt" 2>&1; echo "cost exit $?" >> "$OUT/cost.txt"
  [ -f "$OUT/prof-cost.txt" ] && gzip -f "$OUT/prof-cost.txt"
  timeout "${COST_LIMIT:-200}" python3 -m streamrl.bench.vllm_host_cost --config examples/gpu.toml \
    --shape "${COST_SHAPE:-0.5b}" --engines 2 --variants base nolp >> "$OUT/cost.txt" 2>&1; echo "cost2 exit $?" >> "$OUT/cost.txt"
  grep '^{"figure' "$OUT/cost.txt" >> "$F"; grep -E '^\{"figure|exit|Error' "$OUT/cost.txt" | cut -c1-300
fi

if has tests; then
  # the nodes killed mid-copy first (never concluded in two earlier calls); a test past TESTS_STACK_S prints
  # every thread's stack, so a hang shows where it waits
  timeout "${TESTS_LIMIT:-360}" python3 -m pytest -q -s -p no:cacheprovider -o addopts="--strict-markers -ra --durations=0" \
    -o faulthandler_timeout="${TESTS_STACK_S:-200}" ${TESTS_K:+-k "$TESTS_K"} tests/gpu/test_weights_ipc_gpu.py \
    tests/gpu/test_vllm_gpu.py > "$OUT/vllm_tests.txt" 2>&1
  echo "tests exit $?" >> "$OUT/vllm_tests.txt"
  for f in /tmp/pytest-of-*/pytest-*/test_*killed*/[ab].log; do [ -f "$f" ] && { echo "== $f"; tail -n 30 "$f"; }; done \
    > "$OUT/killed_node_logs.txt" 2>&1
  grep -E "engine|lora|processed|kept kv|holds_ms|s call|passed|failed|Timeout|Error|error" "$OUT/vllm_tests.txt" | tail -30
fi

if has bench; then
  for shape in ${SHAPES:-0.5b}; do
    timeout "${BENCH_LIMIT:-240}" python3 -m streamrl.bench.rollout_throughput --config examples/gpu.toml \
      --shape "$shape" --rounds "${ROUNDS:-3}" --groups "${ROUND_GROUPS:-0}" --hf-groups "${HF_GROUPS:-0}" --out "$F" \
      --kv-at-swap ${KV_MODES:-keep recompute} ${DELTAS:+--deltas} ${BETWEEN:+--between} ${BENCH_SET:+--set "$BENCH_SET"} \
      > "$OUT/bench-${shape/:/-}.txt" 2>&1; echo "bench $shape exit $?" >> "$OUT/bench-${shape/:/-}.txt"
    grep -E '^\{|exit|Error' "$OUT/bench-${shape/:/-}.txt" | cut -c1-400 | tail -12
  done
fi

if has loop; then
  [ -d models/qwen2-0.5b-shape ] || python3 -m streamrl make-tiny-model models/qwen2-0.5b-shape --shape 0.5b \
    --dtype bfloat16 --device cuda > /dev/null 2>&1
  for backend in ${BACKENDS:-vllm hf}; do
    name="gpu-$backend"
    limit=RUN_LIMIT_${backend}; timeout "${!limit:-270}" python3 -m streamrl run --config examples/gpu.toml --rollout-nodes "${NODES:-2}" \
      --steps "${STEPS:-50}" --set "run.dir='$RUNS'" --set "run.name='$name'" --set "rollout.backend='$backend'" \
      > "$OUT/run-$backend.txt" 2>&1; echo "run exit $?" >> "$OUT/run-$backend.txt"
    python3 -m streamrl status --run "$name" --runs-dir "$RUNS" > "$OUT/status-$backend.txt" 2>&1
    echo "status exit $?" >> "$OUT/status-$backend.txt"
    python3 -m streamrl.bench.loop_figures "$RUNS/$name" --skip 8 | sed "s/^{/{\"backend\": \"$backend\", /" >> "$F"
    for f in "$RUNS/$name"/logs/*.log; do echo "== $f"; grep -E "WARNING|ERROR|Traceback|engine warmed|KV cache|graph" "$f" | tail -8; done > "$OUT/logs-$backend.txt" 2>/dev/null
    tail -n 4 "$OUT/run-$backend.txt"; tail -n 2 "$OUT/status-$backend.txt"; tail -n 1 "$F" | cut -c1-600
  done
fi

if has learn; then
  [ -d models/qwen2-0.5b-shape ] || python3 -m streamrl make-tiny-model models/qwen2-0.5b-shape --shape 0.5b \
    --dtype bfloat16 --device cuda > /dev/null 2>&1
  for task in ${TASKS:-copy}; do
    name="gpu-learn-$task"
    timeout "${LEARN_LIMIT:-300}" python3 -m streamrl run --config examples/gpu.toml --rollout-nodes "${NODES:-2}" \
      --steps "${STEPS:-50}" --reward "$task" --set "run.dir='$RUNS'" --set "run.name='$name'" \
      > "$OUT/learn-$task.txt" 2>&1; echo "run exit $?" >> "$OUT/learn-$task.txt"
    python3 -m streamrl.bench.loop_figures "$RUNS/$name" --skip 8 | sed "s/^{/{\"task\": \"$task\", /" >> "$F"
    tail -n 4 "$OUT/learn-$task.txt"; tail -n 1 "$F" | cut -c1-600
  done
fi
