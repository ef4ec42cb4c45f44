"""The `streamrl run` live view: the run's phase and every role's state; once steps finish, their figures."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rich.console import Console

from streamrl.ops.eval_status import eval_rows
from streamrl.ops.phases import RoleState, Snapshot
from streamrl.ops.progress import trained_rate

MIN_WIDTH = 72  # wide enough for a node's state, so the table does not jump as phases change
LABEL_WIDTH = len("mismatch_kl / behavior_kl")
NO_TERMINAL_WIDTH = 200  # columns of the output without a terminal
STATE_STYLE = {"dead": "red", "generating": "green", "training": "green", "up": "green", "registered": "cyan"}


@dataclasses.dataclass
class Frame:
    """What the view shows at one moment: a table on a terminal (`__rich__`), plain lines without one
    (ops/progress.py `PlainProgress` reads the fields)."""

    snapshot: Snapshot
    records: list[dict[str, Any]]
    steps: int
    elapsed_s: float

    def __rich__(self):
        return _table(self.snapshot, self.records, self.steps, self.elapsed_s)


def live_table(snapshot: Snapshot, records: list[dict[str, Any]], steps: int, elapsed_s: float) -> Frame:
    """The run's phase, the latest step's figures (once a step finished), then what each role is
    doing: a start never looks dead, and a role that died says why."""
    return Frame(snapshot, records, steps, elapsed_s)


def _table(snapshot: Snapshot, records: list[dict[str, Any]], steps: int, elapsed_s: float):
    from rich.table import Table

    last = records[-1] if records else {}
    title = f"streamrl — step {last.get('step', 0)}/{steps} — {elapsed_s:.0f} s"
    table = Table(title=title, show_header=False, min_width=MIN_WIDTH)
    table.add_column("what", style="bold", min_width=LABEL_WIDTH)
    table.add_column("value", overflow="fold")
    table.add_row("phase", snapshot.phase)
    for row in _figures(records) if records else []:
        table.add_row(*row)
    roles = ([snapshot.learner] if snapshot.learner is not None else []) + snapshot.nodes
    for role in roles:
        table.add_row(role.name, _styled(role))
    if snapshot.note:
        table.add_row("note", snapshot.note)
    return table


def _styled(role: RoleState) -> str:
    from rich.markup import escape

    style = STATE_STYLE.get(role.state)
    text = escape(str(role))
    return f"[{style}]{text}[/]" if style else text


def _figures(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    last, first_reward = records[-1], records[0].get("reward/mean")

    def fmt(key: str, spec: str = ".3f") -> str:
        value = last.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    reward = f"{fmt('reward/mean')} ± {fmt('reward/std')}"
    if first_reward is not None and len(records) > 1:
        reward += f"   (step 1: {first_reward:.3f})"
    episodes = []
    if "env/episodes" in last:  # multi-turn: what the episodes did (learner/selection.py episode_figures)
        episodes = [
            ("episodes", f"{fmt('env/turns_mean', '.2f')} turns, environment reward {fmt('env/reward_mean')}"),
            ("tool calls", f"{fmt('env/tool_calls', '.0f')} ({fmt('env/tool_failed', '.0f')} failed, "
                           f"{fmt('env/tool_timeouts', '.0f')} timed out)"),
        ]  # fmt: skip
    reward_kl = []
    if "critic/reward_kl_coef" in last:  # a KL penalty in the reward, its coefficient (learner/critic/kl_control.py)
        reward_kl = [
            ("reward KL / its coef", f"{fmt('critic/reward_kl', '.2e')} / {fmt('critic/reward_kl_coef', '.3g')}")
        ]
    return [
        ("reward", reward),
        *episodes,
        *reward_kl,
        ("loss", fmt("loss", ".4f")),
        ("policy version", fmt("version", ".0f")),
        ("tokens/s (trained)", str(trained_rate(records))),
        ("staleness mean / max", f"{fmt('staleness_mean', '.2f')} / {fmt('staleness_max', '.0f')}"),
        ("mismatch_kl / behavior_kl", f"{fmt('mismatch_kl', '.2e')} / {fmt('behavior_kl', '.2e')}"),
        (
            "skipped updates",
            f"{fmt('skipped_steps', '.0f')} non-finite, {fmt('no_gradient_updates', '.0f')} no gradient",
        ),
        ("weights push (s)", fmt("weights_s", ".2f")),
        *eval_rows(records),  # the latest evaluation of each held-out source (ops/eval_status.py)
    ]


def plain_console() -> Console:
    """The console of `streamrl run` and `doctor`: a terminal's own width (asked of the terminal); without
    one (a log, a pipe, CI), NO_TERMINAL_WIDTH. COLUMNS is ignored (rich would take it for the width): a
    log must read the same on a machine that exports it and on one that does not. Text is never wrapped
    (soft wrap): a one-line error stays one line in a log, however long its paths; tables fit the width."""
    environ = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    terminal = Console(_environ=environ).is_terminal
    return Console(width=None if terminal else NO_TERMINAL_WIDTH, soft_wrap=True, emoji=False, _environ=environ)
