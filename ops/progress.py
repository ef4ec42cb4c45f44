"""What a run says about its progress: the one definition of trained tokens/s, and plain lines where there is no
terminal.

- `trained_rate(records)`: trained tokens/s as the live row, the closing line and `streamrl status` all give it.
- `PlainProgress`: stands in for rich's `Live` when the output is not a terminal (a file, nohup, Slurm, a pod's
  log), where a live table is drawn only once, at the end: one plain line per step, the phase as it changes, and
  every EVERY_S seconds without a step, what each role is doing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from rich.console import Console
from rich.markup import escape

EVERY_S = 30.0  # without a finished step, the roles' states this often
# The laps of one learner step (learner/main.py `_Laps`, recorded as time/<lap>): their sum is the step's time.
LAPS = ("time/wait_s", "time/train_s", "time/commit_s", "time/push_s", "time/checkpoint_s")


@dataclasses.dataclass(frozen=True)
class Rate:
    """Trained tokens/s: the completion tokens of the steps that updated the model, divided by the learner's time
    over all the steps (skipped ones included: their time was spent, their tokens trained nothing), less the first
    step's wait (the nodes' start and their first batch, minutes on a loaded machine: the wall time says it)."""

    tokens: int  # completion tokens of the steps that took an update
    seconds: float  # the learner's steps' time (the sum of their laps: waiting, training, commit, push, checkpoint)
    steps: int
    skipped: int  # steps that took no update

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        """What the rate divides by, e.g. `812 tokens/s (9744 trained tokens / 12.0 s of 10 steps, 2 skipped)`."""
        skipped = f", {self.skipped} skipped" if self.skipped else ""
        steps = f"{self.steps} step" + "s" * (self.steps != 1)
        return f"{self.per_s:.0f} tokens/s ({self.tokens} trained tokens / {self.seconds:.1f} s of {steps}{skipped})"


def trained_rate(records: list[dict[str, Any]]) -> Rate:
    """The `Rate` of a run's metrics records (metrics.jsonl, one per step; a resumed run's too)."""
    tokens = sum(int(r.get("completion_tokens", 0)) for r in records if not r.get("skipped"))
    seconds = sum(float(r.get(lap, 0.0)) for r in records for lap in LAPS)
    first = [r for i, r in enumerate(records) if i == 0 or _first_of_launch(records[i - 1], r)]
    seconds -= sum(float(r.get("time/wait_s", 0.0)) for r in first)
    return Rate(tokens, seconds, len(records), sum(1 for r in records if r.get("skipped")))


def _first_of_launch(before: dict[str, Any], record: dict[str, Any]) -> bool:
    """A resumed run's first step (its records follow the earlier launch's in metrics.jsonl): not the step after."""
    step, previous = record.get("step"), before.get("step")
    return isinstance(step, int) and isinstance(previous, int) and step != previous + 1


def step_line(record: dict[str, Any], records: list[dict[str, Any]], steps: int, elapsed_s: float) -> str:
    """One plain line for a finished step: its reward, loss, staleness and nodes, the rate so far."""

    def fmt(key: str, spec: str) -> str:
        value = record.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    skipped = " (skipped: no update)" if record.get("skipped") else ""
    return (
        f"step {record.get('step', '?')}/{steps}{skipped}  reward {fmt('reward/mean', '.3f')} ± "
        f"{fmt('reward/std', '.3f')}  loss {fmt('loss', '.4f')}  trained {trained_rate(records)}  staleness "
        f"{fmt('staleness_mean', '.2f')} (max {fmt('staleness_max', '.0f')})  nodes {fmt('nodes', '.0f')}  "
        f"{elapsed_s:.0f} s"
    )


class PlainProgress:
    """`Live`'s place without a terminal: `update(frame)` prints what is new in the frame (ops/live.py `Frame`)
    as plain lines; on exit the last frame's table (every role as it ended)."""

    def __init__(self, console: Console, every_s: float = EVERY_S):
        self.console, self.every_s = console, every_s
        self.frame = None
        self.printed = 0  # records printed as step lines
        self.phase = ""
        self.said_at = time.monotonic()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.frame is not None:
            self.console.print(self.frame)

    def update(self, frame, refresh: bool = False) -> None:
        self.frame = frame
        records, now = frame.records, time.monotonic()
        for i in range(self.printed, len(records)):
            self._say(step_line(records[i], records[: i + 1], frame.steps, frame.elapsed_s), now)
        self.printed = len(records)
        snapshot = frame.snapshot
        if snapshot.phase != self.phase:
            self.phase = snapshot.phase
            self._say(f"phase: {snapshot.phase} ({frame.elapsed_s:.0f} s)", now)
        elif now - self.said_at >= self.every_s:
            roles = [r for r in [snapshot.learner, *snapshot.nodes] if r is not None]
            states = "; ".join(f"{role.name}: {role}" for role in roles)
            note = f"; {snapshot.note}" if snapshot.note else ""
            self._say(f"{snapshot.phase} ({frame.elapsed_s:.0f} s): {states}{note}", now)

    def _say(self, line: str, now: float) -> None:
        self.console.print(escape(line), soft_wrap=True, highlight=False)
        self.said_at = now


def live_output(console: Console):
    """The live view's output: rich's `Live` on a terminal, else `PlainProgress`."""
    if not console.is_terminal:
        return PlainProgress(console)
    from rich.live import Live

    return Live(console=console, refresh_per_second=2, transient=False)
