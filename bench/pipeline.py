"""Async, measured: the same workload in sync mode and in async mode at several max_staleness, one call.

    python -m streamrl.bench.pipeline [--staleness 0 1 2 4] [--steps 12] [--nodes 1] [--device cpu]
        [--simulate gen=1.0±0.05,train=1.0±0.05] [--config FILE] [--out DIR] [--set section.field=value ...]

Each configuration is a full `streamrl run` (embedded Redis, learner and rollout processes) on the
built-in demo (or the config the `--set`s make). Per configuration, one JSON line: trained tokens/s,
seconds per step, the learner's and the nodes' idle fractions, the staleness histogram at training,
the share of generated samples dropped stale or preempted, and the speed-up over sync measured in the
same call. `--simulate` replaces generation and/or training with timed sleeps of that distribution
(seconds per step), so the scheduler's own overhead shows: `overhead_s` is the step time beyond the
ideal (gen + train for sync, max(gen, train) for async). A markdown table (`pipeline.md`) and PNG
plots (`pipeline_speed.png`, `pipeline_staleness.png`) are written to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import re
import statistics
import tempfile
import time

from streamrl.engine.config import build, load
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher
from streamrl.ops.run import DEMO

WARMUP_STEPS = 2  # engine start-up and the first weights are left out of the rates


def parse_simulate(text: str) -> dict[str, float]:
    """`gen=1.0±0.05,train=2` -> {"gen_s": 1.0, "gen_sd": 0.05, "train_s": 2.0}; `+-` works for `±`."""
    out: dict[str, float] = {}
    for part in filter(None, text.replace("+-", "±").split(",")):
        match = re.fullmatch(r"\s*(gen|train)\s*=\s*([0-9.]+)\s*(?:±\s*([0-9.]+))?\s*", part)
        if not match:
            raise SystemExit(f"--simulate {text!r}: expected gen=MEAN[±SD],train=MEAN[±SD] (seconds per step)")
        out[f"{match[1]}_s"] = float(match[2])
        if match[3]:
            out[f"{match[1]}_sd"] = float(match[3])
    return out


def measure(mode: str, staleness: int, args, folder: str) -> dict:
    name = f"{mode}-s{staleness}" if mode == "async" else "sync"
    base = [] if args.config else DEMO
    sets = [*base, f"run.dir='{folder}'", f"run.name='{name}'", f"run.steps={args.steps}", f"run.mode='{mode}'"]
    sets += [f"ledger.max_staleness={staleness}", "telemetry.tensorboard=false"]
    sets += [f"run.device='{args.device}'"] if args.device else []  # else the config's (the demo's: cpu)
    sets += [f"simulate.{k}={v}" for k, v in args.simulate.items()] + args.sets
    launcher = Launcher(load(args.config, sets) if args.config else build({}, sets))
    started = time.monotonic()
    try:
        launcher.start(args.nodes)
        launcher.learner.process.wait(timeout=3600)
        counts, histogram = _books(launcher)
    finally:
        launcher.stop_all()
    records = read_metrics(launcher.run_dir / "metrics.jsonl")
    if len(records) <= args.warmup_steps + 1:
        raise RuntimeError(f"{name}: only {len(records)} steps finished; see {launcher.run_dir / 'logs'}")
    return {
        **_figures(name, mode, staleness, records, counts, histogram, args.simulate, args.warmup_steps),
        "wall_s": time.monotonic() - started,
    }


def _books(launcher: Launcher) -> tuple:
    ledger = Ledger(connect(launcher.ledger_url), launcher.cfg.run.name)
    return ledger.counts(), ledger.staleness_histogram()


def _figures(name, mode, staleness, records, counts, histogram, simulate, warmup: int = WARMUP_STEPS) -> dict:
    timed = records[warmup:]
    seconds = timed[-1]["time"] - records[warmup - 1]["time"]
    per_step = seconds / len(timed)
    generated = max(1, counts.total)
    clocks = _node_clocks(records[-1], records[warmup - 1])
    out = {
        "figure": "pipeline",
        "config": name,
        "mode": mode,
        "max_staleness": staleness if mode == "async" else 0,
        "steps": len(timed),
        "tokens_per_s": sum(r["completion_tokens"] for r in timed) / seconds,
        "seconds_per_step": per_step,
        "learner_idle_fraction": statistics.mean(r.get("time/idle_fraction", 0.0) for r in timed),
        "rollout_idle_fraction": clocks["idle"] / max(sum(clocks.values()), 1e-9) if clocks else None,
        "node_generate_s": clocks["generate"] / len(timed) if clocks else None,  # per step, all nodes
        "staleness_histogram": {str(k): v for k, v in histogram.items()},
        "stale_share": counts.dropped_by_reason.get("stale", 0) / generated,
        "preempted_share": counts.dropped_by_reason.get("preempted", 0) / generated,
        "generated": counts.total,
        "trained": counts.trained,
        "final_reward": records[-1]["reward/mean"],
        "train_s": statistics.median(r.get("time/train_s", 0.0) for r in timed),
    }
    if mode == "sync":  # the stages run one after the other: the rest of a step is generating (and the push)
        out["gen_s"] = max(per_step - out["train_s"], 0.0)
    gen, train = simulate.get("gen_s", 0.0), simulate.get("train_s", 0.0)
    if gen and train:  # async at max_staleness 0 cannot overlap the stages either
        ideal = gen + train if mode == "sync" or staleness == 0 else max(gen, train)
        out.update(ideal_seconds_per_step=ideal, overhead_s=per_step - ideal)
    return out


def _node_clocks(last: dict, first: dict) -> dict[str, float]:
    """The nodes' own seconds generating / idle / paused for swaps between two records (the timed steps)."""
    nodes = {k.split("/")[1] for k in last if k.startswith("node/") and k.endswith("/idle_s")}
    if not nodes:
        return {}
    return {
        kind: sum(last.get(f"node/{n}/{kind}_s", 0.0) - first.get(f"node/{n}/{kind}_s", 0.0) for n in nodes)
        for kind in ("generate", "idle", "swap")
    }


def speedups(results: list[dict], simulate: dict) -> list[dict]:
    """Each async configuration against sync, measured in the same call, and as a fraction of the ideal
    (gen + train) / max(gen, train): from the simulated stage times, else from the stages measured in
    the sync run (its training seconds per step, and the rest of its step as generation)."""
    sync = next((r for r in results if r["mode"] == "sync"), None)
    out = []
    for r in results:
        if sync is None or r is sync:
            continue
        ratio = r["tokens_per_s"] / sync["tokens_per_s"]
        row = {"figure": "pipeline_speedup", "config": r["config"], "vs": "sync", "ratio": ratio}
        simulated = bool(simulate.get("gen_s") and simulate.get("train_s"))
        gen = simulate["gen_s"] if simulated else sync.get("gen_s", 0.0)
        train = simulate["train_s"] if simulated else sync.get("train_s", 0.0)
        if gen and train:
            ideal = (gen + train) / max(gen, train) if r["max_staleness"] > 0 else 1.0
            row.update(ideal_ratio=ideal, fraction_of_ideal=ratio / ideal, gen_s=gen, train_s=train)
            row["stages"] = "simulated" if simulated else "measured in sync"
        node_gen = sync.get("node_generate_s")
        if not simulated and node_gen and train and r["max_staleness"] > 0:  # the node's own generating time
            ideal = (node_gen + train) / max(node_gen, train)
            row.update(ideal_ratio_node_clock=ideal, fraction_of_ideal_node_clock=ratio / ideal)
        out.append(row)
    return out


def write_table(results: list[dict], gains: list[dict], out: pathlib.Path) -> pathlib.Path:
    ratio = {g["config"]: g["ratio"] for g in gains}
    lines = [
        "| config | tokens/s | s/step | vs sync | learner idle | rollout idle | stale | preempted | staleness |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        idle = r["rollout_idle_fraction"]
        lines.append(
            f"| {r['config']} | {r['tokens_per_s']:.0f} | {r['seconds_per_step']:.3f} | "
            f"{ratio.get(r['config'], 1.0):.2f}× | {r['learner_idle_fraction']:.0%} | "
            f"{'-' if idle is None else format(idle, '.0%')} | {r['stale_share']:.1%} | {r['preempted_share']:.1%} | "
            f"{' '.join(f'{k}:{v}' for k, v in r['staleness_histogram'].items())} |"
        )
    for g in gains:
        if "ideal_ratio" in g and g["ideal_ratio"] > 1:
            lines.append(
                f"\n{g['config']}: {g['ratio']:.2f}× sync = {g['fraction_of_ideal']:.0%} of the ideal "
                f"{g['ideal_ratio']:.2f}× (gen {g['gen_s']:.2f} s + train {g['train_s']:.2f} s per step, {g['stages']})"
            )
    path = out / "pipeline.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot(results: list[dict], out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.bar(names, [r["tokens_per_s"] for r in results], color="tab:blue")
    left.set_title("trained tokens/s")
    xs = range(len(names))
    right.bar([x - 0.2 for x in xs], [r["learner_idle_fraction"] for r in results], width=0.4, label="learner")
    right.bar([x + 0.2 for x in xs], [r["rollout_idle_fraction"] or 0.0 for r in results], width=0.4, label="rollout")
    right.set_xticks(list(xs), names)
    right.set_title("idle fraction")
    right.legend()
    fig.tight_layout()
    speed = out / "pipeline_speed.png"
    fig.savefig(speed, dpi=110)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in results:
        hist = {int(k): v for k, v in r["staleness_histogram"].items()}
        total = max(1, sum(hist.values()))
        ax.plot(sorted(hist), [hist[k] / total for k in sorted(hist)], marker="o", label=r["config"])
    ax.set_xlabel("staleness at training (versions)")
    ax.set_ylabel("share of trained samples")
    ax.legend()
    fig.tight_layout()
    stale = out / "pipeline_staleness.png"
    fig.savefig(stale, dpi=110)
    plt.close("all")
    return [speed, stale]


@contextlib.contextmanager
def _runs_folder(keep: str):
    if keep:
        pathlib.Path(keep).mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="srl-bench-") as folder:
        yield folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="async max_staleness values")
    parser.add_argument("--no-sync", action="store_true", help="leave out the sync baseline")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="leading steps left out of the rates")
    parser.add_argument("--device", default="", help="run.device (default: the config's)")
    parser.add_argument("--config", default="", help="a run config (TOML) instead of the built-in demo")
    parser.add_argument("--simulate", type=parse_simulate, default={}, help="gen=MEAN[±SD],train=MEAN[±SD] (s/step)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."), help="folder for the table and plots")
    parser.add_argument("--dir", default="", help="keep each run's folder (logs, metrics) here; default: a temp folder")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    if args.warmup_steps < 1:
        raise SystemExit(f"--warmup-steps {args.warmup_steps}: give at least 1 (the rates start at a step's end)")
    configs = ([] if args.no_sync else [("sync", 0)]) + [("async", s) for s in args.staleness]
    started = time.monotonic()
    results = []
    with _runs_folder(args.dir) as folder:
        for mode, staleness in configs:  # each line as soon as it is measured
            results.append(measure(mode, staleness, args, folder))
            print(json.dumps(results[-1]), flush=True)
    gains = speedups(results, args.simulate)
    for line in gains:
        print(json.dumps(line), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    files = [write_table(results, gains, args.out), *plot(results, args.out)]
    print(
        json.dumps({"figure": "pipeline_files", "files": [str(f) for f in files], "wall_s": time.monotonic() - started})
    )


if __name__ == "__main__":
    main()
