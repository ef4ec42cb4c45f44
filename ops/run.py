"""The `streamrl run` session: start the launcher, show the live view, stop everything, sum up."""

from __future__ import annotations

import signal
import time

import msgspec
from rich.console import Console
from rich.live import Live

from streamrl.engine.config import Config, ConfigError
from streamrl.engine.telemetry import MetricsTail, read_metrics
from streamrl.ops.launcher import Launcher
from streamrl.ops.live import live_table

# The built-in demo: the random-init tiny model learns to write the letter of the demo task's
# `answer` column. Measured on 2 CPU cores with 2 nodes: mean reward 0.06 -> 1.0 in 30 steps.
# A learning rate this high suits only a tiny random model; examples/demo.toml spells it out.
DEMO = ["learner.lr=1e-2", "rollout.group_size=8", "rollout.max_tokens=24", "run.steps=30"]


def fresh_name(cfg: Config, explicit: bool) -> Config:
    """A default-named run whose folder exists gets a timestamped name; an explicit name is kept."""
    if explicit or not cfg.run.path.exists():
        return cfg
    run = msgspec.structs.replace(cfg.run, name=f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return msgspec.structs.replace(cfg, run=run)


def summary(records: list[dict], wall_s: float) -> str:
    if not records:
        return f"no step finished in {wall_s:.0f} s"
    k = max(1, len(records) // 4)
    first = sum(r["reward/mean"] for r in records[:k]) / k
    last = sum(r["reward/mean"] for r in records[-k:]) / k
    tokens = sum(r.get("completion_tokens", 0) for r in records)
    return (
        f"{len(records)} steps in {wall_s:.0f} s; mean reward {first:.3f} (first {k} steps) -> {last:.3f} "
        f"(last {k}); {tokens} completion tokens trained, {tokens / wall_s:.0f} tokens/s overall"
    )


def run_local(
    cfg: Config, nodes: int, explicit_name: bool = False, console: Console | None = None, resume: str = ""
) -> int:
    """Run to the configured number of steps (or Ctrl-C); the exit status. `resume` (a checkpoint
    folder, or "latest") continues the run of that name in its folder."""
    console = console or Console()
    cfg = fresh_name(cfg, explicit_name or bool(resume))
    launcher = Launcher(cfg, resume=resume)
    try:
        placement = launcher.plan_gpus(nodes)
    except ConfigError as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    console.print(f"run [bold]{cfg.run.name}[/]: folder {launcher.run_dir}, logs in {launcher.run_dir / 'logs'}")
    if placement is not None:
        console.print(placement.describe(nodes))
    started, code = time.monotonic(), 1
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the run as cleanly as Ctrl-C
    try:
        launcher.start(nodes)
        code = _watch(launcher, cfg, console, started)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process this run started[/]")
        code = 130
    except RuntimeError as e:
        console.print(f"[red]error:[/] {e}")
    finally:
        # A second Ctrl-C or a SIGTERM must not cut the clean-up short and leave children running.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            launcher.stop_all(keep_redis=True)
            records = read_metrics(launcher.run_dir / "metrics.jsonl")
            console.print(summary(records, time.monotonic() - started))
            code = _books(launcher, cfg, console) or code
        finally:
            launcher.stop_redis()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return code


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _watch(launcher: Launcher, cfg: Config, console: Console, started: float) -> int:
    tail = MetricsTail(launcher.run_dir / "metrics.jsonl")
    records = tail.records
    with Live(console=console, refresh_per_second=2, transient=False) as live:
        while launcher.learner.alive:
            nodes = {name: child.alive for name, child in launcher.nodes.items()}
            tail.poll()
            finishing = bool(records) and records[-1]["step"] >= cfg.run.steps  # nodes were told to stop
            if nodes and not any(nodes.values()) and not finishing:
                failed = launcher.failed_nodes()
                if not failed:
                    raise RuntimeError(
                        "every rollout node finished (their prompt source ended: data.loop = "
                        "false?) before the learner's last step"
                    )
                raise RuntimeError(
                    f"every rollout node exited; {failed[-1].name} with code "
                    f"{failed[-1].process.returncode}, its log {failed[-1].log_path}:\n"
                    f"{failed[-1].log_tail()}"
                )
            note = "" if any(nodes.values()) or not nodes else "no rollout node is running: the learner waits"
            live.update(live_table(records, cfg.run.steps, nodes, time.monotonic() - started, note))
            time.sleep(0.5)
        nodes = {name: child.alive for name, child in launcher.nodes.items()}
        tail.poll()
        live.update(live_table(records, cfg.run.steps, nodes, time.monotonic() - started))
    console.print()
    code = launcher.learner.process.returncode
    if code != 0:
        console.print(
            f"[red]the learner exited with code {code}[/]; its log {launcher.learner.log_path}:\n"
            f"{launcher.learner.log_tail()}"
        )
    return code


def _books(launcher: Launcher, cfg: Config, console: Console) -> int:
    """The ledger's table; non-zero when the books do not balance."""
    if launcher.ledger_url is None:
        return 0
    from streamrl.ops.status import status_command

    return status_command(cfg.run.name, launcher.ledger_url, console=console)
