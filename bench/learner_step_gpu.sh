#!/usr/bin/env bash
# The learner GPU session: gpu tests, then the learner_step figures (1 GPU, then 2 GPUs under torchrun).
# Run from the repo root on a 2-GPU H200 machine, after installing the carried wheels; logs go to $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B=bench/learner_step.py
python3 -c "import torch, transformers, inspect; from torch.nn.attention.varlen import varlen_attn; print(torch.__version__, transformers.__version__, torch.cuda.device_count(), inspect.signature(varlen_attn))" 2>&1 | tee "$OUT/env.txt"
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_learner_gpu.py 2>&1 | tail -25 > "$OUT/gpu_tests.txt"; cat "$OUT/gpu_tests.txt"
run() { echo "# $*" >> "$OUT/bench.log"; timeout "$@" 2>>"$OUT/bench.err" | tee -a "$OUT/figures.jsonl"; }
run 90 env CUDA_VISIBLE_DEVICES=0 python3 $B --mode baseline
BASE=$(python3 -c "import json;print([json.loads(l) for l in open('$OUT/figures.jsonl') if 'baseline' in l][-1]['tokens_per_s'])" 2>/dev/null || echo 0)
[ -n "${ALL_VARIANTS:-}" ] && run 160 env CUDA_VISIBLE_DEVICES=0 python3 $B --mode streamrl --compile --baseline-tps "$BASE"
run 160 env CUDA_VISIBLE_DEVICES=0 python3 $B --mode streamrl --compile --pad --baseline-tps "$BASE" --profile "$OUT/profile_1gpu_compile_pad.txt"
run 200 python3 -m torch.distributed.run --standalone --nproc_per_node=2 $B --mode streamrl --compile --pad --baseline-tps "$BASE"
tail -c 4000 "$OUT/bench.err" > "$OUT/bench_err_tail.txt"
