"""`streamrl run --fresh` (ops/fresh.py): a run's earlier books are moved aside whole, said, never removed; refused
where it cannot keep its word (a ledger at ledger.url holds the books elsewhere; with --resume)."""

from __future__ import annotations

import pytest

from streamrl.ops.fresh import FreshError, set_aside
from streamrl.ops.lock import LOCK_FILE


def test_the_earlier_books_are_moved_aside_whole(tmp_path):
    run = tmp_path / "run"
    (run / "redis").mkdir(parents=True)
    (run / "redis" / "appendonly.aof").write_text("ledger")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / LOCK_FILE).write_text("{}")  # the hold of the launcher doing this: it stays
    aside = set_aside(run, ledger_url="")
    assert aside.parent == run / "earlier"
    assert sorted(p.name for p in run.iterdir()) == ["earlier", LOCK_FILE]
    assert (aside / "redis" / "appendonly.aof").read_text() == "ledger"
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert set_aside(run, ledger_url="") is None  # nothing left to set aside: the earlier ones stay where they are
    assert (aside / "metrics.jsonl").exists()


@pytest.mark.parametrize(("url", "resume", "said"), [("redis://h:1/0", "", "ledger.url"), ("", "latest", "--resume")])
def test_refused_where_the_books_cannot_be_set_aside(tmp_path, url, resume, said):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(FreshError, match=said):
        set_aside(tmp_path, ledger_url=url, resume=resume)
    assert (tmp_path / "metrics.jsonl").exists()
