"""streamrl beside TRL's GRPOTrainer: a streamrl run's folder and bench/trl_peer.py's lines, one figure and one plot.

    python -m streamrl.bench.one_gpu_vs_trl RUN_FOLDER TRL_JSONL [--plot reward_vs_wall.png] [--out figures.jsonl]

Both sides are counted alike: trained completion tokens of the steps after the first over the wall time from
the first step's end to the last's (the first step of each holds its start-up: compilation, graph capture),
steps per second the same way; the reward of each step against its wall time from the first step's end. Peak
memory: TRL's process (torch's peak, vLLM's share inside it) and streamrl's learner (its metrics). `mode`: the
run's run.mode as its config.toml holds it (what `streamrl run`'s preflight made of 'auto'; 'auto' unresolved,
off a shared GPU, runs async). Prints `{"figure": "one_gpu_vs_trl", "mode",
"streamrl_tok_s", "trl_tok_s", "ratio", ...}`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from streamrl.engine.config import load
from streamrl.engine.telemetry import read_metrics


def _rate(times: list[float], tokens: list[float]) -> tuple[float | None, float | None]:
    """(tokens/s, steps/s) over the steps after the first: their tokens over the time from the first's end."""
    seconds = times[-1] - times[0] if len(times) > 1 else 0.0
    if seconds <= 0:
        return None, None
    return round(sum(tokens[1:]) / seconds, 1), round((len(times) - 1) / seconds, 4)


def streamrl_side(run: pathlib.Path) -> dict:
    records = read_metrics(run / "metrics.jsonl")
    if not records:
        raise SystemExit(f"{run}: no metrics.jsonl records (did the run train a step?)")
    times = [r["time"] for r in records]
    tok_s, steps_s = _rate(times, [r.get("completion_tokens", 0) for r in records])
    cfg = load(str(run / "config.toml"))
    peaks = [r["memory/learner_peak_gib"] for r in records if "memory/learner_peak_gib" in r]
    return {
        "mode": "sync" if cfg.run.mode == "sync" else "async",
        "max_staleness": cfg.ledger.max_staleness,
        "tok_s": tok_s,
        "steps_per_s": steps_s,
        "steps": len(records),
        "curve": [(t - times[0], r["reward/mean"]) for t, r in zip(times, records)],
        "peak_gib": round(max(peaks), 2) if peaks else None,
    }


def trl_side(path: pathlib.Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [line for line in lines if line.get("figure") == "trl_step"]
    runs = [line for line in lines if line.get("figure") == "trl_run"]
    if not steps:
        raise SystemExit(f"{path}: no trl_step lines (bench/trl_peer.py --out writes them)")
    times = [s["wall_s"] for s in steps]
    tok_s, steps_s = _rate(times, [s["completion_tokens"] for s in steps])
    return {
        "tok_s": tok_s,
        "steps_per_s": steps_s,
        "steps": len(steps),
        "curve": [(t - times[0], s["reward_mean"]) for t, s in zip(times, steps)],
        "peak_gib": runs[-1].get("peak_gib") if runs else steps[-1].get("peak_gib"),  # a run cut at its limit
        "vllm": runs[-1].get("vllm") if runs else None,
    }


def figure(ours: dict, theirs: dict) -> dict:
    ratio = round(ours["tok_s"] / theirs["tok_s"], 3) if ours["tok_s"] and theirs["tok_s"] else None
    out = {"figure": "one_gpu_vs_trl", "mode": ours["mode"], "streamrl_tok_s": ours["tok_s"],
           "trl_tok_s": theirs["tok_s"], "ratio": ratio}  # fmt: skip
    for side, got in (("streamrl", ours), ("trl", theirs)):
        out |= {f"{side}_steps_per_s": got["steps_per_s"], f"{side}_steps": got["steps"],
                f"{side}_peak_gib": got["peak_gib"], f"{side}_reward_first": round(got["curve"][0][1], 4),
                f"{side}_reward_last": round(got["curve"][-1][1], 4)}  # fmt: skip
    return out | {"trl_vllm": theirs["vllm"]}


def plot(ours: dict, theirs: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, got in ((f"streamrl ({ours['mode']})", ours), ("TRL GRPOTrainer", theirs)):
        ax.plot([t for t, _ in got["curve"]], [r for _, r in got["curve"]], marker=".", label=name)
    ax.set_xlabel("seconds from the first step's end")
    ax.set_ylabel("mean reward of the step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=pathlib.Path, help="the streamrl run's folder")
    parser.add_argument("trl", type=pathlib.Path, help="bench/trl_peer.py's --out file")
    parser.add_argument("--plot", type=pathlib.Path, help="reward against wall time, both runs")
    parser.add_argument("--out", default="", help="also append the figure line to this file")
    args = parser.parse_args(argv)
    ours, theirs = streamrl_side(args.run), trl_side(args.trl)
    line = figure(ours, theirs)
    print(json.dumps(line), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")
    if args.plot:
        plot(ours, theirs, args.plot)
    return line


if __name__ == "__main__":
    main()
