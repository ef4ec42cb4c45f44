#!/usr/bin/env bash
# The learner GPU session on a 2-GPU H200 machine: gpu tests (and with ATTENTION=1 the attention-kernel
# bench) beside the eager baseline, then 1-GPU
# streamrl variants two at a time (one per GPU; the first is profiled), then 2-GPU runs under torchrun.
# Figures (JSON lines) go to $OUT/figures.jsonl; a table is printed last.
#   VARIANTS="|--unit-params 1|--budget 32768 --micro-batches 2"   1-GPU variants, '|'-separated ('' = defaults)
#   TWO_GPU="|--budget 32768 --micro-batches 2"                    2-GPU variants, likewise
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=bench/learner_step.py
STREAMRL="--mode streamrl --compile --pad"
on() { local gpu=$1 limit=$2; shift 2; echo "# gpu$gpu $*" >> "$OUT/bench.log"
       CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python3 "$@" 2>>"$OUT/bench_gpu$gpu.err" >> "$OUT/figures.jsonl"; }
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())" | tee "$OUT/env.txt"
(CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_learner_gpu.py > "$OUT/gpu_tests.txt" 2>&1
 [ -z "${ATTENTION-}" ] || CUDA_VISIBLE_DEVICES=0 timeout 120 python3 bench/attention_kernels.py >> "$OUT/figures.jsonl" 2>>"$OUT/bench_gpu0.err") &
on 1 90 $B --mode baseline
wait; tail -3 "$OUT/gpu_tests.txt"
BASE=$(python3 -c "import json;print([json.loads(l) for l in open('$OUT/figures.jsonl') if 'baseline' in l][-1]['tokens_per_s'])" 2>/dev/null || echo 0)
IFS='|' read -ra ONE <<< "${VARIANTS-|--unit-params 1}"
for ((i = 0; i < ${#ONE[@]}; i += 2)); do
  prof=(); [ "$i" = 0 ] && prof=(--profile "$OUT/profile_1gpu.txt")
  on 0 170 $B $STREAMRL --baseline-tps "$BASE" ${ONE[i]} "${prof[@]}" &
  [ $((i + 1)) -lt ${#ONE[@]} ] && on 1 170 $B $STREAMRL --baseline-tps "$BASE" ${ONE[i+1]} &
  wait
done
IFS='|' read -ra TWO <<< "${TWO_GPU-}"
[ ${#TWO[@]} = 0 ] && TWO=("")
for v in "${TWO[@]}"; do
  echo "# torchrun 2 gpus $v" >> "$OUT/bench.log"
  timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node=2 $B $STREAMRL --baseline-tps "$BASE" $v \
    2>>"$OUT/bench_2gpu.err" >> "$OUT/figures.jsonl"
done
for f in "$OUT"/*.err; do echo "== $f"; tail -c 3000 "$f"; rm "$f"; done > "$OUT/errors.txt"  # few files come back
python3 - "$OUT/figures.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try: f = json.loads(line)
    except ValueError: continue
    if f.get("figure") != "attention_kernel" and "tokens_per_s" not in f: print("   ", line.strip()[:300]); continue
    if f.get("figure") == "attention_kernel":
        print("attention", {k: v for k, v in f.items() if k != "figure"}); continue
    print(f"{f['figure']:<52} {f['tokens_per_s']:>7} tok/s MFU {f['mfu']:.3f} vs_base {f.get('vs_baseline', '-')} "
          f"{f.get('seconds_per_step')} s/step budget {f.get('budget', '-')} peak {f.get('peak_gib')} GiB "
          f"busy {f.get('gpu_busy_fraction', '-')}")
    if "gpu_ms_by_kind" in f: print("   ", f["gpu_ms_by_kind"])
    for gap in f.get("gpu_idle_gaps", []): print("    idle", gap["ms"], "ms during", ", ".join(gap["host"]))
    if "gpu_idle_ms_by_gap" in f: print("    kernels", f["kernels_per_step"], "idle ms by gap", f["gpu_idle_ms_by_gap"])
    if f.get("host_syncs"): print("    host syncs at", ", ".join(f["host_syncs"]))
PY
