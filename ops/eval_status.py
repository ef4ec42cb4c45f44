"""`streamrl status`: the run's evaluations, shown apart from the training books (which they never touch).

One line per evaluated version: its state (open, complete, incomplete) and, per source, the prompts done of
those asked (an open job: its chunks handed in of those laid out, `not laid out` before a node took it up).
"""

from __future__ import annotations

from streamrl.engine.ledger.eval_jobs import EvalJobs


def eval_lines(client, run: str) -> list[str]:
    """The lines; none for a run without evaluations."""
    jobs = EvalJobs(client, run)
    lines = []
    for job in jobs.jobs():
        version, state = int(job["version"]), job.get("state", "?")
        asked = {k.removeprefix("asked:"): int(v) for k, v in job.items() if k.startswith("asked:")}
        if state == "open":
            p = jobs.progress(version)
            said = f"{p.done}/{p.chunks} chunks in" if p.chunks >= 0 else "not laid out yet"
            sources = ", ".join(f"{s} {n} prompts" for s, n in asked.items())
            lines.append(f"eval v{version}: open, {said}" + (f" ({sources})" if sources else ""))
            continue
        done = ", ".join(f"{s} {job.get('done:' + s, '0')}/{n} prompts" for s, n in asked.items())
        lines.append(f"eval v{version}: {state}" + (f", {done}" if done else ""))
    return lines


def eval_rows(records: list[dict]) -> list[tuple[str, str]]:
    """The live view's rows: per source, its latest evaluation beside its first (`pass@1 0.41 (v10); v0: 0.06`),
    or the coverage of one that did not complete. Read from the step records that carry them."""
    latest: dict[str, list[dict]] = {}
    for record in records:
        for key in record:
            kind, _, rest = key.partition("/")
            source, _, name = rest.rpartition("/")
            if kind == "eval" and name == "complete":
                latest.setdefault(source, []).append(record)
    rows = []
    for source, found in latest.items():
        first = f"; first {_said(found[0], source)}" if len(found) > 1 else ""
        rows.append((f"eval {source}", _said(found[-1], source) + first))
    return rows


def _said(record: dict, source: str) -> str:
    at = f"v{record.get(f'eval/{source}/version', -1):.0f}"
    if not record.get(f"eval/{source}/complete"):
        done, asked = record.get(f"eval/{source}/prompts_done", 0), record.get(f"eval/{source}/prompts_asked", 0)
        return f"{at} incomplete ({done:.0f}/{asked:.0f} prompts)"
    return f"{at} pass@1 {record.get(f'eval/{source}/pass@1', float('nan')):.3f}"
