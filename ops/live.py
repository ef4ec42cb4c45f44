"""The `streamrl run` live view: the latest step's figures and the nodes' state, as a rich table."""

from __future__ import annotations

from typing import Any


def live_table(records: list[dict[str, Any]], steps: int, nodes: dict[str, bool], elapsed_s: float, note: str = ""):
    """The `streamrl run` live view: the latest step's figures and the nodes' state."""
    from rich.table import Table

    last = records[-1] if records else {}
    first_reward = records[0].get("reward/mean") if records else None
    table = Table(title=f"streamrl — step {last.get('step', 0)}/{steps} — {elapsed_s:.0f} s", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")

    def fmt(key: str, spec: str = ".3f") -> str:
        value = last.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    reward = f"{fmt('reward/mean')} ± {fmt('reward/std')}"
    if first_reward is not None and len(records) > 1:
        reward += f"   (step 1: {first_reward:.3f})"
    rows = [
        ("reward", reward),
        ("loss", fmt("loss", ".4f")),
        ("policy version", fmt("version", ".0f")),
        ("tokens/s (trained)", fmt("tokens_per_s", ".0f")),
        ("staleness mean / max", f"{fmt('staleness_mean', '.2f')} / {fmt('staleness_max', '.0f')}"),
        ("mismatch_kl / behavior_kl", f"{fmt('mismatch_kl', '.2e')} / {fmt('behavior_kl', '.2e')}"),
        ("skipped steps", fmt("skipped_steps", ".0f")),
        ("weights push (s)", fmt("weights_s", ".2f")),
        ("nodes", ", ".join(f"{n} {'up' if up else 'down'}" for n, up in nodes.items()) or "-"),
    ]
    for row in rows:
        table.add_row(*row)
    if note:
        table.add_row("note", note)
    return table
