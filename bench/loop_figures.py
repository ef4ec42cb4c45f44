"""A finished run's figures from its folder: the learner inside the loop, the weight push, the nodes, the books.

    python -m streamrl.bench.loop_figures RUN_FOLDER [--skip 5] [--standalone-mfu 0.40] [--raw-broadcast-ms 3.1]
        [--raw-copy-ms 0.35]

Prints one JSON line (`figure: loop`). In-loop MFU counts the learner's training time only (waiting for
data is reported apart, as idle) and is taken over the steps after `--skip` (the first ones compile).
Given the standalone figures measured in the same call, it also reports the ratios the GPU-loop issue
asks for: in-loop MFU / standalone MFU, the push's hold / a raw NCCL broadcast of the same bytes, and on
one GPU (weights by CUDA IPC) the learner's blocking time per push (the longer of the push's hold on the
host and its packing on the device: both delay the next step) / a device-to-device copy of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

from streamrl.engine.telemetry import read_metrics


def _median(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(values), 5) if values else None


def _node_figures(last: dict) -> dict:
    nodes = sorted({k.split("/")[1] for k in last if k.startswith("node/")})
    return {n: {k.rsplit("/", 1)[1]: round(v, 3) for k, v in last.items() if k.startswith(f"node/{n}/")} for n in nodes}


def _learning(records: list[dict]) -> dict:
    """Whether the run still learns at its end: the mean reward of the 5 steps up to the middle one, the reward's
    least-squares slope a step over the second half, and the share of steps that had no gradient (every group's
    rewards equal: nothing left to learn from them)."""
    rewards = [r["reward/mean"] for r in records]
    half = len(rewards) // 2
    tail = rewards[half:]
    xs = range(len(tail))
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(tail)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, tail)) / spread if spread else 0.0
    return {
        "reward_mid5": round(statistics.fmean(rewards[max(0, half - 5) : half] or rewards[:1]), 4),
        "reward_slope_second_half": round(slope, 5),
        "no_gradient_share": round(sum(r.get("skipped_no_gradient", 0) > 0 for r in records) / len(records), 3),
    }


def figures(run: pathlib.Path, skip: int, standalone_mfu: float, raw_ms: float, copy_ms: float = 0.0) -> dict:
    records = read_metrics(run / "metrics.jsonl")
    if not records:
        return {"figure": "loop", "run": str(run), "steps": 0}
    steady = records[skip:] or records
    k = min(5, len(records))
    out = {
        "figure": "loop",
        "run": str(run),
        "steps": len(records),
        "reward_first5": round(sum(r["reward/mean"] for r in records[:k]) / k, 4),
        "reward_last5": round(sum(r["reward/mean"] for r in records[-k:]) / k, 4),
        **_learning(records),
        "skipped_steps": records[-1].get("skipped_steps"),
        "trained_tokens_per_step": _median([r.get("train_tokens_per_s", 0) * r.get("time/train_s", 0) for r in steady]),
        "mfu_in_loop": _median([r.get("mfu") for r in steady]),
        "train_tokens_per_s": _median([r.get("train_tokens_per_s") for r in steady]),
        "train_s": _median([r.get("time/train_s") for r in steady]),
        "wait_s": _median([r.get("time/wait_s") for r in steady]),
        "idle_fraction": _median([r.get("time/idle_fraction") for r in steady]),
        "push_hold_ms": _median([1000 * r.get("time/push_s", 0) for r in steady]),
        "push_hold_max_ms": round(max(1000 * r.get("time/push_s", 0) for r in steady), 3),
        "push_pack_ms": _median([1000 * r.get("time/push_pack_s", 0) for r in steady]),
        "push_pack_device_ms": _median([1000 * r.get("time/push_pack_device_s", 0) for r in steady]),
        "transfer_ms": _median([1000 * r.get("weights_s", 0) for r in steady]),
        "evicted": records[-1].get("evicted"),
        "learner_peak_gib": round(max(r.get("memory/learner_peak_gib", 0.0) for r in records), 2),
        "nodes": _node_figures(records[-1]),
        "wall_s": round(records[-1]["time"] - records[0]["time"], 1),
    }
    if standalone_mfu and out["mfu_in_loop"]:
        out["mfu_vs_standalone"] = round(out["mfu_in_loop"] / standalone_mfu, 3)
    if raw_ms and out["push_hold_ms"] is not None:
        out["push_hold_vs_raw_broadcast"] = round(out["push_hold_ms"] / raw_ms, 3)
        out["transfer_vs_raw_broadcast"] = round((out["transfer_ms"] or 0) / raw_ms, 3)
    blocking = [1000 * max(r.get("time/push_s", 0), r.get("time/push_pack_device_s", 0)) for r in steady]
    out["push_blocking_ms"] = _median(blocking)
    if copy_ms and out["push_blocking_ms"] is not None:
        out["push_blocking_vs_copy"] = round(out["push_blocking_ms"] / copy_ms, 3)
        out["push_hold_vs_copy"] = round(out["push_hold_ms"] / copy_ms, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=pathlib.Path)
    parser.add_argument("--skip", type=int, default=5, help="leading steps left out of the medians (compiling)")
    parser.add_argument("--standalone-mfu", type=float, default=0.0)
    parser.add_argument("--raw-broadcast-ms", type=float, default=0.0)
    parser.add_argument("--raw-copy-ms", type=float, default=0.0, help="a device-to-device copy of the weights")
    args = parser.parse_args()
    line = figures(args.run, args.skip, args.standalone_mfu, args.raw_broadcast_ms, args.raw_copy_ms)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
