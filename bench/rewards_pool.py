"""Rewards/s through the worker pool against calling the same reward inline, in the same run.

For each reward (the demo task's, a cheap one; math-verify, a costly one) and batch size, the
baseline is the inline call (reward.workers = 0); the pool runs with 1 and 2 workers. One JSON
line per figure: rewards/s, the ratio to inline, and the pool's overhead per sample (pool time
minus inline time, divided by the samples). A last line times a hung call (cut at its deadline)
and the next call, which a freshly started replacement worker serves.

    python -m streamrl.bench.rewards_pool [--batches 40] [--sizes 16,256] [--workers 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from streamrl.engine.config import RewardConfig
from streamrl.rewards import build_scorer, demo_rows

HANG = (
    "import time\ndef hang(prompts, completions, completion_ids, **columns):\n"
    "    if 'hang' in completions:\n        time.sleep(3600)\n    return [1.0] * len(completions)\n"
)


def make_batch(kind: str, n: int, seed: int) -> tuple[list[str], list[str], list[list[int]], list[dict]]:
    rng = random.Random(seed)
    if kind == "demo":
        rows = demo_rows(n, seed)
        completions = ["".join(rng.choice("ab c") for _ in range(32)) for _ in range(n)]
    else:
        rows = [{"prompt": "half?", "answer": rng.choice([r"\frac{1}{2}", "0.5", "3"])} for _ in range(n)]
        completions = [rng.choice([r"so \boxed{0.5}", r"$\boxed{\frac{2}{4}}$", "it is 3"]) for _ in range(n)]
    return [r["prompt"] for r in rows], completions, [[1] * 32] * n, [{"answer": r["answer"]} for r in rows]


def rate(cfg: RewardConfig, batch, batches: int) -> float:
    """Median seconds per batch, after one warm-up batch (workers booted, modules imported)."""
    with build_scorer(cfg) as scorer:
        scorer.score(*batch)
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            rewards = scorer.score(*batch)
            times.append(time.perf_counter() - t0)
        assert None not in rewards, f"benchmark batch failed: {scorer.stats}"
    return statistics.median(times)


def figures(kind: str, size: int, workers: list[int], batches: int) -> list[dict]:
    function = {"demo": "demo", "math": "math"}[kind]
    batch = make_batch(kind, size, seed=size)
    inline_s = rate(RewardConfig(functions=[function], workers=0), batch, batches)
    rows = [
        dict(
            figure="rewards_per_s",
            reward=kind,
            batch=size,
            mode="inline",
            workers=0,
            value=size / inline_s,
            ratio_vs_inline=1.0,
            overhead_us_per_sample=0.0,
        )
    ]
    for w in workers:
        pool_s = rate(RewardConfig(functions=[function], workers=w), batch, batches)
        rows.append(
            dict(
                figure="rewards_per_s",
                reward=kind,
                batch=size,
                mode="pool",
                workers=w,
                value=size / pool_s,
                ratio_vs_inline=inline_s / pool_s,
                overhead_us_per_sample=(pool_s - inline_s) / size * 1e6,
            )
        )
    return rows


def hang_recovery(timeout_s: float) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(HANG)
    cfg = RewardConfig(functions=[f"{f.name}:hang"], workers=1, timeout_s=timeout_s)
    try:
        with build_scorer(cfg) as scorer:
            scorer.score(["p"], ["ok"], [[1]], [{}])  # boot the worker
            t0 = time.perf_counter()
            assert scorer.score(["p"], ["hang"], [[1]], [{}]) == [None]  # cut at the deadline, worker replaced
            hung_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            assert scorer.score(["p"], ["ok"], [[1]], [{}]) == [1.0]  # the replacement: its start + one call
            next_s = time.perf_counter() - t1
    finally:
        os.unlink(f.name)
    return dict(
        figure="hang_recovery_s",
        timeout_s=timeout_s,
        value=hung_s,
        next_call_s=next_s,
        ratio_vs_deadline=hung_s / timeout_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--sizes", default="16,256")
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--rewards", default="demo,math")
    args = parser.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    for kind in args.rewards.split(","):
        for size in (int(s) for s in args.sizes.split(",")):
            batches = args.batches if kind == "demo" else max(3, args.batches // 10)
            for row in figures(kind, size, workers, batches):
                print(json.dumps(row), flush=True)
    print(json.dumps(hang_recovery(1.0)), flush=True)


if __name__ == "__main__":
    main()
