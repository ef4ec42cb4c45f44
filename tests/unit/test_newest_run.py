"""`streamrl status` without `--run`: the run folder whose books changed last, never a stray folder."""

from __future__ import annotations

import os

from typer.testing import CliRunner

from streamrl.cli import app
from streamrl.ops.status import newest_run


def test_the_newest_run_is_the_one_whose_books_changed_last(tmp_path):
    assert newest_run(tmp_path / "absent") == ""
    (tmp_path / "logs-only").mkdir()  # no ledger, config or metrics: not a run
    assert newest_run(tmp_path) == ""
    for age, name in ((300, "old"), (100, "new"), (200, "middle")):
        (tmp_path / name / "redis").mkdir(parents=True)
        os.utime(tmp_path / name / "redis", (0, 10_000 - age))
    assert newest_run(tmp_path) == "new"
    (tmp_path / "old" / "metrics.jsonl").write_text("{}\n")  # it trained again just now
    assert newest_run(tmp_path) == "old"


def test_status_without_a_run_and_without_run_folders_says_what_to_give(tmp_path):
    said = CliRunner().invoke(app, ["status", "--runs-dir", str(tmp_path / "nothing")])
    assert said.exit_code == 2 and "no run folder in" in said.output and "give --run NAME" in said.output
