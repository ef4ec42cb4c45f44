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
