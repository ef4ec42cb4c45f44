"""The closing line of a `streamrl run`: what this launch trained, told apart from earlier launches of the run.

A resumed run appends to the run's metrics.jsonl; the records written before this launch started (by earlier
launchers, or by a learner that died past its last checkpoint and whose steps this launch trains again) are
not this launch's: they are named apart (`resumed at step 12; 48 steps since, in 31 s ...; earlier launches
wrote 13 steps`). Torn lines (a crash, a full disk) are skipped and counted.
"""

from __future__ import annotations

import math
import pathlib

from streamrl.engine.telemetry import EVENTS_FILE, ending_torn, read_jsonl
from streamrl.learner.evaluation.report import first_to_last
from streamrl.ops.progress import trained_rate


def summary(records: list[dict], wall_s: float, since: bool = False) -> str:
    """The closing line: steps (and how many took no update), the reward's first and last quarter, trained
    tokens/s as the live row gives it (ops/progress.py `trained_rate`), the wall time. `since`: the steps are
    those since a resume."""
    if not records:
        return f"no step finished in {wall_s:.0f} s"
    scored = [r["reward/mean"] for r in records if "reward/mean" in r]  # a step left without samples has none
    k = max(1, len(scored) // 4)
    first, last = (sum(scored[:k]) / k, sum(scored[-k:]) / k) if scored else (math.nan, math.nan)
    skipped = sum(1 for r in records if r.get("skipped"))
    steps = f"{len(records)} steps" + (f" ({skipped} skipped: no update)" if skipped else "")
    return (
        f"{steps}{' since,' * since} in {wall_s:.0f} s; mean reward {first:.3f} (first {k} steps) -> {last:.3f} "
        f"(last {k}); trained {trained_rate(records)}; {wall_s:.0f} s wall"
    )


def closing_line(run_dir: pathlib.Path, since: float, wall_s: float, resumed: bool) -> str:
    """The closing line of a launch that started at wall-clock `since` and ran `wall_s`: `summary` of its own
    records; a resumed launch also says where it resumed and how many steps earlier launches wrote."""
    records, torn = read_jsonl(run_dir / "metrics.jsonl")
    torn_events = read_jsonl(run_dir / EVENTS_FILE)[1]
    ours = [r for r in records if _time(r) >= since]
    earlier = len(records) - len(ours)
    line = summary(ours, wall_s, since=resumed or bool(earlier))
    if resumed or earlier:
        at = f"resumed at step {int(ours[0]['step']) - 1}" if ours else "resumed"
        last = f" (the last: step {_last(records, since)})" if earlier else ""
        line = f"{at}; {line}; earlier launches wrote {earlier} steps{last}"
    skips = [f"{torn} torn line(s) of metrics.jsonl"] * bool(torn)
    skips += [f"{torn_events} of events.jsonl"] * bool(torn_events)
    skips += ["a torn end.json"] * ending_torn(run_dir)
    line += f" ({', '.join(skips)} skipped)" if skips else ""
    return "\n".join([line, *first_to_last(ours)])  # each held-out source's first -> last evaluation


def _time(record: dict) -> float:
    value = record.get("time", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _last(records: list[dict], since: float) -> int:
    return max(int(r.get("step", 0)) for r in records if _time(r) < since)
