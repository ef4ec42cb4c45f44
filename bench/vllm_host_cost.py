"""Where a vLLM engine's time goes per running sequence: raw AsyncLLM, the node's engine arguments and
SamplingParams, every group submitted at once, with one thing changed per variant.

    python -m streamrl.bench.vllm_host_cost --config examples/gpu.toml --shape 0.5b --variants base nolp final half
    python -m streamrl.bench.vllm_host_cost --config examples/gpu.toml --shape 0.5b --engines 2

Variants (each a round after a warm-up round of `base`):
- base: the node's SamplingParams (n = group size, the sampled token's processed logprob, flat, DELTA outputs)
- nolp: no logprobs (what the per-token logprob costs the engine core and the front end)
- final: FINAL_ONLY outputs (what a RequestOutput a step costs the front end)
- half: half the groups (whether the cost is per step or per sequence)

`--engines N` runs N engines in N processes on the one device, each with 1/N of the groups, their timed rounds
started together (a file barrier): what a second front end and engine core buy when one engine's host work is the
limit. One JSON line per variant (per engine and summed with --engines): sequences, tokens, seconds, tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

RESULT = "HOST-COST "


async def _round(backend, prompts, cfg, variant: str) -> dict:
    from vllm.sampling_params import RequestOutputKind

    from streamrl.bench.rollout_throughput import generate_all

    n = cfg.rollout.group_size
    params = backend.sampling_params(n, cfg.rollout.max_tokens)
    params.ignore_eos = True  # every sequence runs max_tokens: rounds comparable
    if variant == "nolp":
        params.logprobs = None
    if variant == "final":
        params.output_kind = RequestOutputKind.FINAL_ONLY
    chosen = prompts[: len(prompts) // 2] if variant == "half" else prompts
    start = time.perf_counter()
    tokens = sum(await generate_all(backend._engine, chosen, params))
    seconds = time.perf_counter() - start
    return {"variant": variant, "seqs": len(chosen) * n, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "start": start, "end": start + seconds}  # fmt: skip


async def _engine(args, barrier: str, rank: int) -> list[dict]:
    from streamrl.bench.rollout_throughput import _config
    from streamrl.engine.models import load_tokenizer
    from streamrl.rollout.backends import build_backend
    from streamrl.rollout.sources import PromptSource

    groups = args.groups // args.engines
    args.set = [*args.set, f"rollout.max_concurrent_groups={groups}"]  # the engine sized for its share
    cfg = _config(args, args.model, args.device, "vllm")
    tokenizer = load_tokenizer(args.model, cfg.model.trust_remote_code)
    source = iter(PromptSource(cfg.data, tokenizer, seed=cfg.run.seed + rank))
    prompts = [next(source).prompt_ids for _ in range(groups)]
    backend = build_backend(cfg, args.device)
    lines = []
    try:
        await _round(backend, prompts, cfg, "base")  # warm-up
        if barrier:
            open(f"{barrier}/ready-{rank}", "w").close()
            while len(os.listdir(barrier)) < args.engines:
                await asyncio.sleep(0.01)
        for variant in args.variants:
            lines.append(await _round(backend, prompts, cfg, variant) | {"engine": rank})
            print(json.dumps(lines[-1]), file=sys.stderr, flush=True)
    finally:
        await backend.close()
    return lines


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--shape", default="", help="SHAPE[:152k] (default: the config's model)")
    parser.add_argument("--groups", type=int, default=120, help="groups in a round, over all engines")
    parser.add_argument("--variants", nargs="+", default=["base", "nolp", "final", "half"])
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", help=argparse.SUPPRESS)  # in a child
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--barrier", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    from streamrl.rollout.backends import resolve_device

    args.device = resolve_device(args.device)
    if args.rank >= 0:
        print(RESULT + json.dumps(asyncio.run(_engine(args, args.barrier, args.rank))), flush=True)
        return
    from streamrl.bench.rollout_throughput import _config_model, _model

    with tempfile.TemporaryDirectory() as tmp:
        model = _model(args.shape, tmp) if args.shape else _config_model(args)
        barrier = os.path.join(tmp, "barrier")
        os.mkdir(barrier)
        cmd = [sys.executable, "-m", "streamrl.bench.vllm_host_cost", "--model", model, "--groups", str(args.groups),
               "--engines", str(args.engines), "--device", args.device, "--variants", *args.variants,
               "--barrier", barrier if args.engines > 1 else "",
               *(["--config", args.config] if args.config else []), *[f"--set={s}" for s in args.set]]  # fmt: skip
        children = [subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, text=True)
                    for r in range(args.engines)]  # fmt: skip
        results = []
        for child in children:
            out, _ = child.communicate(timeout=3600)
            got = [json.loads(line[len(RESULT) :]) for line in out.splitlines() if line.startswith(RESULT)]
            if child.returncode or not got:
                raise SystemExit(f"engine child: exit {child.returncode}")
            results.append(got[-1])
    for i, variant in enumerate(args.variants):
        rounds = [lines[i] for lines in results]
        span = max(r["end"] for r in rounds) - min(r["start"] for r in rounds)
        tokens = sum(r["tokens"] for r in rounds)
        print(json.dumps({"figure": "vllm_host_cost", "shape": args.shape or "config", "engines": args.engines,
                          "variant": variant, "seqs": sum(r["seqs"] for r in rounds), "tokens": tokens,
                          "seconds": round(span, 3), "tokens_per_s": round(tokens / span, 1),
                          "per_engine_tok_s": [r["tokens_per_s"] for r in rounds]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
