"""`streamrl run --fresh`: the run started again under its name, its old books kept aside, never silently.

A run that cannot be resumed (stopped before its first checkpoint, or checkpoints off) cannot be run again under
its name either: its ledger has trained, and a learner refuses to continue a run's versions with fresh weights.
`--fresh` moves what the earlier launches wrote (the embedded ledger, metrics, events, checkpoints, exports,
logs, its ending) into RUN/earlier/<time>/, says so, and starts from step 1. Done while this launcher owns the
folder (ops/lock.py), so never under a live run. A run whose ledger is elsewhere (ledger.url) keeps its books
there: refused, naming the way on.
"""

from __future__ import annotations

import pathlib
import time

from streamrl.ops.lock import LOCK_FILE

EARLIER = "earlier"


class FreshError(ValueError):
    """A run that `--fresh` cannot set aside; the message says why and the way on."""


def set_aside(run_dir: pathlib.Path, ledger_url: str, resume: str = "") -> pathlib.Path | None:
    """Move the folder's books into RUN/earlier/<time>/ (its path; None when the folder holds none yet)."""
    if resume:
        raise FreshError("--fresh starts the run again from step 1; --resume continues it: give one of them")
    if ledger_url:
        raise FreshError(
            "--fresh sets aside the run folder's own ledger, but this run's books are in the ledger at ledger.url: "
            "start it under another run.name (--set run.name=OTHER)"
        )
    books = [p for p in run_dir.iterdir() if p.name not in (LOCK_FILE, EARLIER)] if run_dir.is_dir() else []
    if not books:
        return None
    aside = run_dir / EARLIER / time.strftime("%Y%m%d-%H%M%S")
    aside.mkdir(parents=True)
    for path in books:
        path.rename(aside / path.name)
    return aside
