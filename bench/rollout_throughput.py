"""Rollout throughput: tokens/s of the vllm backend vs the hf backend, same model, same prompts, same run.

    python -m streamrl.bench.rollout_throughput [--prompts 32] [--group-size 4] [--max-tokens 64] [--size small]

Prints one JSON line per backend and round, then the ratio (vllm / hf): the median of the
rounds' ratios, each round measuring both backends back to back (on a shared machine the load
of others swings either figure several-fold between minutes). Each backend runs in its own
child process and gets every group at once through the `GenerationBackend` interface (vLLM
batches continuously; hf batches whatever is queued), after one untimed pass of the same shape
(vLLM's first full batch is several times slower). Tokens counted are completion tokens returned.
With --min-tokens, each group gets its own max_tokens (a random model never stops early, so
this is how completions of varied length are emulated): vLLM frees a finished sequence's slot
at once, the hf backend runs each batch to its longest request. Besides wall-clock tokens/s,
tokens per CPU-second (this process and its children, so vLLM's
engine core counts) is reported: it moves less with other people's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 32))] for _ in range(count)]


def _cpu_seconds() -> float:
    """User + system CPU of this process and its children (vLLM's engine core is one)."""
    import psutil

    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


async def _measure(engine, prompts: list[list[int]], group_size: int, lengths: list[int], repeats: int) -> dict:
    """Best of `repeats` timed passes over every prompt, after one untimed pass of the same shape."""
    best = None
    for i in range(repeats + 1):
        start, cpu = time.perf_counter(), _cpu_seconds()
        groups = await asyncio.gather(*(engine.generate(p, group_size, n) for p, n in zip(prompts, lengths)))
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        if i and (best is None or tokens / seconds > best["tokens_per_s"]):
            best = {
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
                "cpu_seconds": round(cpu, 3),
                "tokens_per_cpu_s": round(tokens / max(cpu, 1e-9), 1),
            }
    return best


async def _run_backend(backend: str, model: str, args) -> dict:
    from streamrl.engine.config import ModelConfig, RolloutConfig
    from streamrl.rollout.backends.hf import HFBackend
    from streamrl.rollout.backends.vllm import VLLMBackend

    model_cfg = ModelConfig(max_model_len=args.max_tokens + 64, dtype=args.dtype)
    rollout = RolloutConfig(backend=backend, temperature=1.0, max_tokens=args.max_tokens)
    engine = (VLLMBackend if backend == "vllm" else HFBackend)(model, model_cfg, rollout, seed=0)
    try:
        rng = random.Random(1)
        lengths = [rng.randint(args.min_tokens or args.max_tokens, args.max_tokens) for _ in range(args.prompts)]
        return await _measure(engine, _prompts(args.prompts, 400), args.group_size, lengths, args.repeats)
    finally:
        await engine.close()


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="per-group max_tokens drawn from [min, max] (RL completions vary in length); "
        "0: all groups get --max-tokens",
    )
    parser.add_argument("--size", choices=("medium", "small", "tiny"), default="small")  # engine.models.SHAPES
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per backend (best is reported)")
    parser.add_argument("--model", default="", help="model folder (default: a random-init Qwen2 of --size)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="hf-then-vllm rounds; the ratio is the median over rounds (shared machines are noisy)",
    )
    parser.add_argument("--only", choices=("vllm", "hf"), help=argparse.SUPPRESS)  # one backend, in a child
    return parser.parse_args()


def _child(backend: str, model: str, args: argparse.Namespace) -> dict:
    """Measure one backend in a fresh process: vLLM changes thread settings of the process it runs in."""
    cmd = [
        sys.executable,
        "-m",
        "streamrl.bench.rollout_throughput",
        "--prompts",
        str(args.prompts),
        "--group-size",
        str(args.group_size),
        "--max-tokens",
        str(args.max_tokens),
        "--dtype",
        args.dtype,
        "--min-tokens",
        str(args.min_tokens),
        "--repeats",
        str(args.repeats),
        "--model",
        model,
        "--only",
        backend,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{backend} benchmark failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    args = _parse()
    if args.only:
        print(json.dumps(asyncio.run(_run_backend(args.only, args.model, args))), flush=True)
        return
    from streamrl.engine.models import SHAPES, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_tiny_model(os.path.join(tmp, "model"), seed=0, **SHAPES[args.size]))
        shape = dict(
            model=args.model or f"random-qwen2-{args.size}",
            prompts=args.prompts,
            group_size=args.group_size,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            dtype=args.dtype,
            repeats=args.repeats,
        )
        ratios = []
        for round_ in range(args.rounds):
            results = {}
            for backend in ("hf", "vllm"):
                results[backend] = _child(backend, model, args)
                print(
                    json.dumps(
                        {
                            "figure": "rollout_tokens_per_s",
                            "backend": backend,
                            "round": round_,
                            **shape,
                            **results[backend],
                        }
                    ),
                    flush=True,
                )
            ratios.append({k: results["vllm"][k] / results["hf"][k] for k in ("tokens_per_s", "tokens_per_cpu_s")})
    figures = {
        "tokens_per_s": "rollout_speedup_vllm_over_hf",
        "tokens_per_cpu_s": "rollout_cpu_efficiency_vllm_over_hf",
    }
    for key, name in figures.items():
        per_round = [r[key] for r in ratios]
        print(
            json.dumps(
                {
                    "figure": name,
                    "ratio": round(statistics.median(per_round), 2),
                    "ratio_per_round": [round(r, 2) for r in per_round],
                    "goal": 3.0,
                    **shape,
                }
            )
        )


if __name__ == "__main__":
    main()
