#!/usr/bin/env bash
# One GPU at users' sizes (issue 55): examples/gpu-1.5b.toml (full fine-tune) and gpu-7b-lora.toml on the long-tailed
# lengths task, each run end to end with vLLM, then its books and a `one_gpu_size` line. Run on the device machine
# from a clean copy of the project after vLLM is installed there (`source .vp-setup/vllm-setup.sh`, streamrl
# importable). RUNS picks, in order: "1.5b:async 1.5b:sync 7b:auto" (SIZE:MODE[:PRESET]); STEPS (30), RUN_LIMIT
# (seconds a run may take, 280). Models are made once per machine under /root/models (kept while the machine is warm).
# Size 0.5b is the one-GPU example (examples/gpu.toml, the copy task); PRESET ppo runs it with the critic (issue 50:
# loss.preset ppo, one completion a prompt, PPO_GROUPS prompts a step, 480: the 60 x 8 samples of GRPO's step), so
# "0.5b:async 0.5b:async:ppo" gives the critic's memory, step time and in-loop MFU beside GRPO's, one machine.
# BACKEND (vllm): hf runs without vLLM (one device call: only .whl carried); the learner's figures are the same.
# NODES: rollout nodes (the config's default else); SETS: more --set overrides, space-separated (an H100 with hf
# nodes: NODES=1 SETS="learner.activation_checkpointing=true": hf's kept logits are 25 GiB a node at 152k vocab).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; DIR=/tmp/runs; F="$OUT/figures.jsonl"
declare -A CONFIG=([0.5b]=examples/gpu.toml [1.5b]=examples/gpu-1.5b.toml [7b]=examples/gpu-7b-lora.toml)
for run in ${RUNS:-1.5b:async 1.5b:sync 7b:auto}; do
  size=${run%%:*}; rest=${run#*:}; mode=${rest%%:*}; preset=${rest#"$mode"}; preset=${preset#:}
  model=/root/models/qwen2-$size-shape; name="size-$size-$mode${preset:+-$preset}"; sets=()
  [ "$preset" = ppo ] && sets=(--set "loss.preset='ppo'" --set "rollout.group_size=1"
                               --set "learner.groups_per_step=${PPO_GROUPS:-480}")
  [ -f "$model/config.json" ] || python3 -m streamrl make-tiny-model "$model" --shape "$size:152k" --dtype bfloat16 \
    --device cuda > "$OUT/model-$size.txt" 2>&1
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 1000 > "$OUT/smi-$name.txt" 2>&1 &
  smi=$!
  for extra in ${SETS:-}; do sets+=(--set "$extra"); done  # SETS: more overrides, space-separated
  timeout "${RUN_LIMIT:-280}" python3 -m streamrl run --config "${CONFIG[$size]}" --steps "${STEPS:-30}" ${NODES:+--rollout-nodes "$NODES"} \
    --set "run.dir='$DIR'" --set "run.name='$name'" --set "model.path='$model'" --set "run.mode='$mode'" \
    --set "rollout.backend='${BACKEND:-vllm}'" "${sets[@]}" > "$OUT/run-$name.txt" 2>&1
  echo "run exit $?" >> "$OUT/run-$name.txt"; kill $smi
  python3 -m streamrl status --run "$name" --runs-dir "$DIR" > "$OUT/status-$name.txt" 2>&1
  echo "status exit $?" >> "$OUT/status-$name.txt"
  loop=$(python3 -m streamrl.bench.loop_figures "$DIR/$name" --skip 3)
  LOOP="$loop" python3 - "$DIR/$name/metrics.jsonl" "$OUT/smi-$name.txt" "${CONFIG[$size]}" "$mode" "${preset:-grpo}" \
    >> "$F" <<'PY'
import json, os, sys
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.progress import trained_rate
rows = read_metrics(sys.argv[1]) if os.path.exists(sys.argv[1]) else []
loop = json.loads(os.environ["LOOP"] or "{}")
smi = [float(l) for l in open(sys.argv[2]) if l.strip().replace(".", "").isdigit()]
rate = trained_rate(rows)  # the run's one definition (live row, closing line, status)
critic = {k: rows[-1].get(f"critic/{k}") for k in ("vf_explained_var", "vf_loss")} if rows else {}
print(json.dumps({"figure": "one_gpu_size", "config": sys.argv[3], "mode": sys.argv[4], "preset": sys.argv[5],
    "steps": len(rows), **critic,
    "trained_tok_s": round(rate.per_s, 1), "gpu_peak_gib": round(max(smi, default=0) / 1024, 1),
    "learner_peak_gib": loop.get("learner_peak_gib"), "mfu_in_loop": loop.get("mfu_in_loop"),
    "idle_fraction": loop.get("idle_fraction"), "train_s": loop.get("train_s"), "wait_s": loop.get("wait_s"),
    "skipped_steps": loop.get("skipped_steps"), "evicted": loop.get("evicted"), "reward_first5": loop.get("reward_first5"),
    "reward_last5": loop.get("reward_last5"), "wall_s": loop.get("wall_s")}))
PY
  for f in "$DIR/$name"/logs/*.log; do echo "== $f"; grep -E "WARNING|ERROR|Traceback|Error" "$f" | tail -6; done \
    > "$OUT/logs-$name.txt" 2>/dev/null
  tail -n 3 "$OUT/run-$name.txt"; tail -n 2 "$OUT/status-$name.txt"; tail -n 1 "$F"
done
