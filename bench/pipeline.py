"""End-to-end pipeline throughput: trained completion tokens/s with 1 rollout node vs N, same run.

    python -m streamrl.bench.pipeline [--steps 12] [--nodes 1 2] [--device cpu] [--set section.field=value ...]

Each configuration is a full `streamrl run` (embedded Redis, learner and rollout processes) on the
built-in demo; the first 2 steps (engine start-up, first weights) are left out of the rate. Prints
one JSON line per configuration, then each one's ratio against the first (the baseline).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from streamrl.engine.config import build
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher
from streamrl.ops.run import DEMO

WARMUP_STEPS = 2


def measure(nodes: int, steps: int, device: str, sets: list[str], folder: str) -> dict:
    cfg = build(
        {},
        [
            *DEMO,
            f"run.dir='{folder}'",
            f"run.name='bench-{nodes}'",
            f"run.steps={steps}",
            f"run.device='{device}'",
            "telemetry.tensorboard=false",
            *sets,
        ],
    )
    launcher = Launcher(cfg)
    started = time.monotonic()
    try:
        launcher.start(nodes)
        launcher.learner.process.wait(timeout=3600)
    finally:
        launcher.stop_all()
    records = read_metrics(launcher.run_dir / "metrics.jsonl")
    timed = records[WARMUP_STEPS:]
    if len(timed) < 2:
        raise RuntimeError(f"only {len(records)} steps finished; see {launcher.run_dir / 'logs'}")
    seconds = timed[-1]["time"] - records[WARMUP_STEPS - 1]["time"]
    tokens = sum(r["completion_tokens"] for r in timed)
    return {
        "figure": "pipeline_tokens_per_s",
        "nodes": nodes,
        "device": device,
        "steps": len(timed),
        "tokens_per_s": tokens / seconds,
        "seconds_per_step": seconds / len(timed),
        "stale_share": _stale_share(records),
        "wall_s": time.monotonic() - started,
        "final_reward": records[-1]["reward/mean"],
    }


def _stale_share(records: list[dict]) -> float:
    """Samples dropped as stale over all samples that reached the learner (its counters are cumulative)."""
    stale = records[-1].get("samples_stale", 0)
    return stale / max(1, stale + sum(r["samples"] for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="srl-bench-") as folder:
        results = [measure(n, args.steps, args.device, args.sets, folder) for n in args.nodes]
    for result in results:
        print(json.dumps(result))
    base = results[0]["tokens_per_s"]
    for result in results[1:]:
        print(
            json.dumps(
                {
                    "figure": "pipeline_speedup",
                    "nodes": result["nodes"],
                    "baseline_nodes": results[0]["nodes"],
                    "ratio": result["tokens_per_s"] / base,
                }
            )
        )


if __name__ == "__main__":
    main()
