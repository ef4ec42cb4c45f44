#!/usr/bin/env bash
# One GPU against TRL (issue 35): TRL's GRPOTrainer (vLLM colocated in its process) and streamrl's one-GPU run (a vLLM
# node beside the learner), one after the other in one device call, on the same model folder, prompts, reward, group
# size, max tokens, learning rate and prompts a step (examples/gpu.toml, read by both), then the figure and the plot
# (bench/one_gpu_vs_trl.py).
#
# On your machine, once:   bench/gpu_trl.sh fetch       # TRL's wheels (py3.12) into .whl-trl/ (ignored), 61 MiB
# The device calls (back to back, the machine stays warm ~30 s between them):
#   the vLLM parts (../shared/tools/vllm-gpu-parts.sh's header), then
#   run  command: mkdir -p /root/trlwheels && cp .whl-trl/* /root/trlwheels/      carry: [".whl-trl"]
#   run  command: source .vp-setup/vllm-setup.sh && python3 -m pip install -q --no-index --no-deps --no-compile \
#          --target /tmp/site .whl/*.whl /root/trlwheels/*.whl && ln -sfn $PWD /tmp/site/streamrl && \
#          export PYTHONPATH=/tmp/site:$PYTHONPATH && bench/gpu_trl.sh          carry: [".whl", ".vp-setup"]
# TRL 1.16.0 takes vLLM 0.22-0.31 (it warns outside) and builds its engine as `LLM(...,
# distributed_executor_backend="external_launcher")` (read in its source against vLLM 0.25.1's; not yet run on a GPU).
# Knobs: STEPS (30), TRL_LIMIT / RUN_LIMIT (seconds each, 270), TRL_MEMORY (vLLM's share in TRL's process, 0.3),
# TRL_MICRO_BATCHES (gradient accumulation over TRL's 480 completions a step, 4), MODES (streamrl's run.mode, a run
# each: "auto", the mode preflight picks), TRL (0: no TRL run; the figures take the last call's /tmp/trl.jsonl, so
# a second call `TRL=0 MODES=sync bench/gpu_trl.sh` on the warm machine adds sync beside the same TRL run).
set -u
TRL_WHEELS="trl==1.16.0 datasets==5.2.0 accelerate==1.16.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
  pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 pyarrow==24.0.0"
if [ "${1:-}" = fetch ]; then
  set -e
  root=$(git rev-parse --show-toplevel); cd "$root"
  grep -qx '/.whl-trl/' .git/info/exclude 2>/dev/null || echo '/.whl-trl/' >> .git/info/exclude
  # shellcheck disable=SC2086  # one word a wheel
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl-trl $TRL_WHEELS
  du -sh .whl-trl; exit 0
fi

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; RUNS=/tmp/runs; F="$OUT/figures.jsonl"; STEPS=${STEPS:-30}
MODEL=models/qwen2-0.5b-shape
[ -d "$MODEL" ] || python3 -m streamrl make-tiny-model "$MODEL" --shape 0.5b --dtype bfloat16 --device cuda \
  > /dev/null 2>&1

if [ "${TRL:-1}" = 1 ]; then
  rm -f /tmp/trl.jsonl
  timeout "${TRL_LIMIT:-270}" python3 -m streamrl.bench.trl_peer --config examples/gpu.toml --model "$MODEL" \
    --steps "$STEPS" --vllm-colocate --vllm-memory "${TRL_MEMORY:-0.3}" --micro-batches "${TRL_MICRO_BATCHES:-4}" \
    --out /tmp/trl.jsonl > "$OUT/trl.txt" 2>&1; echo "trl exit $?" >> "$OUT/trl.txt"
  grep -E 'trl_run|exit|Error' "$OUT/trl.txt" | cut -c1-600 | tail -6
fi
cp /tmp/trl.jsonl "$OUT/trl.jsonl" 2>/dev/null

# streamrl in each of MODES: auto is what preflight picks for this GPU (its info line says which and why); sync has
# the node asleep while the learner trains (TRL's `vllm_enable_sleep_mode`, off by default there and here)
for mode in ${MODES:-auto}; do
  name="vs-trl-$mode"
  timeout "${RUN_LIMIT:-270}" python3 -m streamrl run --config examples/gpu.toml --rollout-nodes "${NODES:-2}" --steps "$STEPS" \
    --set "run.dir='$RUNS'" --set "run.name='$name'" --set "rollout.backend='vllm'" --set "run.mode='$mode'" \
    > "$OUT/run-$mode.txt" 2>&1
  echo "run exit $?" >> "$OUT/run-$mode.txt"
  grep -E "info: gpu" "$OUT/run-$mode.txt" | cut -c1-300; tail -n 4 "$OUT/run-$mode.txt"
  python3 -m streamrl status --run "$name" --runs-dir "$RUNS" > "$OUT/status-$mode.txt" 2>&1
  tail -n 2 "$OUT/status-$mode.txt"
  python3 -m streamrl.bench.one_gpu_vs_trl "$RUNS/$name" "$OUT/trl.jsonl" --plot "$OUT/one_gpu_vs_trl-$mode.png" \
    --out "$F"
  python3 -m streamrl.bench.loop_figures "$RUNS/$name" --skip 5 \
    | sed "s/^{/{\"backend\": \"vllm\", \"run_mode\": \"$mode\", /" >> "$F"
  grep -h '"asleep"' "$RUNS/$name/events.jsonl" | tail -n 2
  tail -n 2 "$F" | cut -c1-600
done
