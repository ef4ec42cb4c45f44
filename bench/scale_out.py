"""How far one learner scales out: N simulated rollout nodes against one learner, one Redis, one push.

    python -m streamrl.bench.scale_out [--nodes 1 8 32 128] [--steps 12] [--group-s 2.0] [--group-size 4]
        [--tokens 1024] [--per-worker 32] [--train-s 0.2] [--out docs] [--set section.field=value ...]
        [--relay-fanouts 0 4]

Per N, one `streamrl run`'s learner (the built-in tiny model on CPU; its step a `simulate.train_s` sleep,
its weights pushed for real) and an embedded Redis, started by the product's `Launcher`, and N rollout
nodes with `rollout.backend`'s sleeping engine (rollout/backends/sim.py), `--per-worker` of them in one
process: each node is the product's own `serve` (its id, control and trajectory sockets, ledger
connection, credits and weight receiver are its own). Each node generates one group at a time
(`max_concurrent_groups = 1`), `--group-s` seconds a group of `--group-size` samples of `--tokens`
completion tokens. The learner takes `N / 2` groups a step (at least 4) with `max_staleness = 2`, so
the credits (3 steps' groups) never leave a node idle and the offered load is N x group-size /
group-s samples/s.

One JSON line per N (`figure: scale_out`), over `--steps` steps from the first step begun once every
node registered (the learner is then stopped with SIGTERM, as a person stops it):
intake (samples/s and bytes/s the learner's intake took), Redis (commands/s, round trips per group,
its CPU share from INFO cpu, calls by command), the push (`push_all_s`: from the learner's publish to
the last node's version live, median over versions, from RUN/events.jsonl), the learner's wait share,
the learner's own CPU share and its threads at the window's end (`learner_threads`: a weights link
is one), drops by reason, registration (first to last node joined) and the books (`streamrl status`).
A plot (intake vs offered; push time vs N) goes to `--out`. `--relay-fanouts`: each N is run once per
`weights.relay_fanout` given, back to back (the line says which), to compare a link per node with the relay tree.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from streamrl.bench._scale_out_nodes import cpu_seconds, ended, start_workers, threads
from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import Trajectory, encode
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_jsonl, read_metrics
from streamrl.ops.launcher import Launcher

HEARTBEAT_S = 0.5  # rollout/control.py's period: a node's control heartbeat to the learner


def run_sets(n: int, args, folder: str) -> list[str]:
    groups = max(4, n // 2)
    gen_s = args.group_s * groups  # sim.py: each group takes gen_s / groups_per_step
    sets = [f"run.dir='{folder}'", f"run.name='n{n}'", "run.steps=100000", "run.device='cpu'"]  # stopped by us
    sets += [f"learner.groups_per_step={groups}", "ledger.max_staleness=2", "rollout.max_concurrent_groups=1"]
    sets += [f"rollout.group_size={args.group_size}", f"rollout.max_tokens={args.tokens}", "reward.workers=0"]
    sets += [f"simulate.gen_s={gen_s}", f"simulate.train_s={args.train_s}", "telemetry.tensorboard=false"]
    sets += ["checkpoint.budget=0", "learner.stall_warn_s=60", "learner.stall_stop_s=0"]
    return sets + args.sets


class RedisMeter:
    """INFO snapshots: commands by name, CPU seconds (user + sys), all commands processed."""

    def __init__(self, url: str):
        self.client = connect(url)

    def snapshot(self) -> dict:
        stats = self.client.info("commandstats")
        cpu = self.client.info("cpu")
        return {
            "calls": {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()},
            "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
            "commands": self.client.info("stats")["total_commands_processed"],
            "t": time.time(),
        }


def sample_bytes(group_size: int, tokens: int) -> int:
    """One trajectory's frame as the node sends it (sim.py's tokens and logprobs, a 16-token prompt)."""
    traj = Trajectory(sample_id="node-0-abcdef-g0:0", group_id="node-0-abcdef-g0", node_id="node-0", seq=0,
                      prompt_ids=[1] * 16, completion_ids=[7] * tokens, behavior_logprobs=[-1.0] * tokens,
                      reward=1.0, policy_version=1, group_size=group_size)  # fmt: skip
    return len(encode(traj))


def wait_for_step(run_dir: pathlib.Path, step: int, learner, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        if records and records[-1]["step"] >= step:
            return records
        if not learner.alive:
            raise RuntimeError(f"the learner exited before step {step}:\n{learner.log_tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"step {step} not reached within {timeout_s:.0f} s:\n{learner.log_tail()}")


def read_events(run_dir: pathlib.Path) -> list[dict]:
    """events.jsonl's records so far (a line a node is still writing is skipped, never fatal)."""
    path = run_dir / "events.jsonl"
    return read_jsonl(path)[0] if path.exists() else []


def push_all_s(events: list[dict], records: list[dict], n: int) -> tuple[float, int]:
    """Median over versions of the time from the learner's publish (its `published` event) to the last of
    the `n` nodes with that version live, and how many versions reached every node. A learner without that
    event: its `step` event less the checkpoint lap (later than the publish by the step's report, which
    takes longer the more nodes it reports on: that estimate is short by as much)."""
    checkpoint_s = {r["step"]: r.get("time/checkpoint_s", 0.0) for r in records}
    published = {e["version"]: e["t"] - checkpoint_s.get(e["step"], 0.0) for e in events if e["event"] == "step"}
    published |= {e["version"]: e["t"] for e in events if e["event"] == "published"}
    live: dict[int, list[float]] = {}
    for e in events:
        if e["event"] == "live":
            live.setdefault(e["version"], []).append(e["t"])
    spans = [max(live[v]) - t for v, t in published.items() if len(live.get(v, ())) >= n]
    return (statistics.median(spans) if spans else float("nan")), len(spans)


def registration(events: list[dict]) -> dict:
    """Distinct nodes that joined, and the seconds from the first join to the last."""
    joined = [e for e in events if e["event"] == "node_joined"]
    times = sorted(e["t"] for e in joined)
    span = round(times[-1] - times[0], 3) if times else None
    return {"registered": len({e["node"] for e in joined}), "register_all_s": span}


def window(records: list[dict], key: str) -> tuple[float, float]:
    """`key`'s growth and the seconds from the end of the first record (the step before the window) to the last."""
    return records[-1].get(key, 0) - records[0].get(key, 0), records[-1]["time"] - records[0]["time"]


def books(launcher: Launcher) -> str:
    """`streamrl status` of the run (its last line: whether the books balance)."""
    command = [sys.executable, "-m", "streamrl", "status", "--run", launcher.cfg.run.name, "--runs-dir",
               str(launcher.run_dir.parent)]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[-1] if lines else out.stderr.strip()[-300:]


def trained_by_node(ledger: Ledger) -> dict[str, int]:
    """Samples trained per node, from the ledger's per-version sets (a group id is `<node>-<incarnation>-g<k>`)."""
    out: dict[str, int] = {}
    for key in ledger.client.scan_iter(match=ledger.prefix + "tv:*", count=1000):
        for sample_id in ledger.client.smembers(key):
            node = sample_id.rsplit("-", 2)[0]
            out[node] = out.get(node, 0) + 1
    return out


def measure(n: int, args, folder: str) -> dict:
    """One run of N nodes: its figure line (and the ledger's trained samples per node, for the test).
    The window is `args.steps` steps from the first step begun once every node registered; then the
    learner is stopped (SIGTERM: it stops the nodes and resolves what it holds)."""
    launcher = Launcher(build({}, run_sets(n, args, folder)))
    workers: list[subprocess.Popen] = []
    try:
        launcher.start(0)
        meter = RedisMeter(launcher.ledger_url)
        started = time.monotonic()
        workers = start_workers(launcher, n, args.per_worker)
        first = wait_registered(launcher.run_dir, n, launcher.learner, args.timeout_s) + 1
        wait_for_step(launcher.run_dir, first, launcher.learner, args.timeout_s)
        ledger = Ledger(connect(launcher.ledger_url), launcher.cfg.run.name, launcher.cfg.ledger)

        def take() -> tuple:
            return meter.snapshot(), cpu_seconds(launcher.learner.process, workers), ledger.counts()

        before, cpu_before, books_before = take()
        records = wait_for_step(launcher.run_dir, first + args.steps, launcher.learner, args.timeout_s)
        after, cpu_after, books_after = take()
        learner_threads = threads(launcher.learner.process.pid)
        launcher.learner.process.send_signal(signal.SIGTERM)
        launcher.learner.process.wait(timeout=120)
        killed = sum(ended(w, deadline=time.monotonic() + 120) is None for w in workers)
        counts, per_node = ledger.counts(), trained_by_node(ledger)
        wall_s = time.monotonic() - started
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        launcher.stop_all()
    cpu = [b - a for a, b in zip(cpu_before, cpu_after, strict=True)]
    steady = [r for r in records if first < r["step"] <= first + args.steps]
    start = next(r for r in records if r["step"] == first)
    line = figures(n, args, [start, *steady], read_events(launcher.run_dir), before, after, cpu)
    line["drops"] = drop_shares(books_before, books_after)  # within the window
    line["drops_at_stop"] = {
        r: k - books_after.dropped_by_reason.get(r, 0) for r, k in counts.dropped_by_reason.items()
    }
    line.update(nodes_trained=len(per_node), workers_killed=killed, wall_s=round(wall_s, 1), books=books(launcher),
                learner_threads=learner_threads)  # fmt: skip
    return {"line": line, "trained_by_node": per_node}


def drop_shares(before, after) -> dict[str, float]:
    """Samples dropped in the window by reason, as shares of the samples admitted in it."""
    admitted = max(after.total - before.total, 1)
    reasons = after.dropped_by_reason
    return {r: round((n - before.dropped_by_reason.get(r, 0)) / admitted, 4) for r, n in reasons.items()
            if n > before.dropped_by_reason.get(r, 0)}  # fmt: skip


def wait_registered(run_dir: pathlib.Path, n: int, learner, timeout_s: float) -> int:
    """Wait until `n` distinct nodes joined (RUN/events.jsonl); the learner's last finished step then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if registration(read_events(run_dir))["registered"] >= n:
            metrics = run_dir / "metrics.jsonl"
            records = read_metrics(metrics) if metrics.exists() else []
            return records[-1]["step"] if records else 0
        if not learner.alive:
            raise RuntimeError(f"the learner exited before {n} nodes registered:\n{learner.log_tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"{n} nodes did not register within {timeout_s:.0f} s")


def figures(n: int, args, records: list[dict], events: list[dict], before: dict, after: dict, cpu: list[float]):
    """The figure line of one N from the metrics, the events and the Redis snapshots of the window."""
    received, seconds = window(records, "samples_received")
    groups = received / args.group_size
    steady = records[1:]
    busy = sum(r.get("time/wait_s", 0) + r.get("time/train_s", 0) + r.get("time/commit_s", 0)
               + r.get("time/push_s", 0) + r.get("time/checkpoint_s", 0) for r in steady)  # fmt: skip
    redis_s = after["t"] - before["t"]
    calls = {k: v - before["calls"].get(k, 0) for k, v in after["calls"].items()}
    push_s, versions = push_all_s(events, records, n)
    intake = received / seconds
    return {
        "figure": "scale_out",
        "nodes": n,
        "offered_samples_s": round(n * args.group_size / args.group_s, 2),
        "intake_samples_s": round(intake, 2),
        "intake_bytes_s": round(intake * sample_bytes(args.group_size, args.tokens)),
        "push_all_s": round(push_s, 4),
        "push_versions": versions,
        "nodes_live": len({e["role"] for e in events if e["event"] == "live"}),  # nodes that took a version live
        "weights_s_max": round(max(r.get("weights_s", 0.0) for r in steady), 4),
        "ledger_ops_s": round((after["commands"] - before["commands"]) / redis_s, 1),
        "ledger_calls_per_group": round(sum(calls.values()) / max(groups, 1), 2),
        "calls_per_group": {
            k: round(v / max(groups, 1), 2)
            for k, v in sorted(calls.items(), key=lambda kv: -kv[1])
            if v / max(groups, 1) >= 0.05
        },  # fmt: skip
        "redis_cpu_share": round((after["cpu_s"] - before["cpu_s"]) / redis_s, 4),
        "learner_cpu_share": round(cpu[0] / redis_s, 4),  # of one core
        "nodes_cpu_share": round(cpu[1] / redis_s, 4),  # every node process together
        "learner_wait_share": round(sum(r.get("time/wait_s", 0) for r in steady) / max(busy, 1e-9), 4),
        "step_s": round(seconds / len(steady), 3),
        "heartbeats_s": round(n / HEARTBEAT_S, 1),
        **registration(events),
        "groups_per_step": max(4, n // 2),
        "group_size": args.group_size,
        "tokens": args.tokens,
        "load": os.getloadavg()[0],
    }


def plot(lines: list[dict], out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    nodes = [r["nodes"] for r in lines]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot([r["offered_samples_s"] for r in lines], [r["intake_samples_s"] for r in lines], "o-", label="intake")
    top = max(r["offered_samples_s"] for r in lines)
    left.plot([0, top], [0, top], "--", color="grey", label="intake = offered")
    for r in lines:
        left.annotate(f"N={r['nodes']}", (r["offered_samples_s"], r["intake_samples_s"]), fontsize=8)
    left.set(xlabel="offered samples/s", ylabel="learner intake samples/s", title="intake vs offered load")
    left.legend()
    right.plot(nodes, [r["push_all_s"] for r in lines], "o-")
    right.set(xscale="log", xlabel="nodes", ylabel="publish -> live on every node (s)", title="push time vs N")
    fig.tight_layout()
    fig.savefig(out / "scale_out.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--group-s", type=float, default=2.0, help="seconds one node takes per group")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="completion tokens per sample")
    parser.add_argument("--per-worker", type=int, default=32, help="simulated nodes per process")
    parser.add_argument("--train-s", type=float, default=0.2, help="the learner's step (a sleep)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for a step")
    parser.add_argument("--dir", default="", help="keep the run folders here (a temporary folder when empty)")
    parser.add_argument("--out", default="", help="folder for scale_out.png (none when empty)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="section.field=value")
    parser.add_argument("--relay-fanouts", type=int, nargs="*", default=[], help="weights.relay_fanout per run")
    args = parser.parse_args()
    lines = []
    for n in args.nodes:
        for fanout in args.relay_fanouts or [None]:
            sets = args.sets if fanout is None else [*args.sets, f"weights.relay_fanout={fanout}"]
            with tempfile.TemporaryDirectory(prefix="scale-out-") as folder:
                lines.append(measure(n, argparse.Namespace(**{**vars(args), "sets": sets}), args.dir or folder)["line"])
            if fanout is not None:
                lines[-1]["relay_fanout"] = fanout
            print(json.dumps(lines[-1]), flush=True)
    if args.out:
        plot(lines, pathlib.Path(args.out))


if __name__ == "__main__":
    main()
