"""`streamrl status`: the newest run without `--run`, and a learner process seen gone before its heartbeat lapses."""

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


def test_a_learner_process_of_this_machine_that_is_gone_is_not_running(tmp_path):
    """RUN/learner.json names the process; the ledger's heartbeat may outlive it by a TTL."""
    import json
    import socket
    import subprocess
    import sys

    from streamrl.engine.weights.paths import boot_id
    from streamrl.ops.status import _process_gone

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"incarnation": "abc", "pid": dead.pid, "host": socket.gethostname(), "boot_id": boot_id()}
    (tmp_path / "learner.json").write_text(json.dumps(record))
    assert _process_gone({"incarnation": "abc"}, tmp_path) == f"the learner process {dead.pid} is gone"
    assert _process_gone({"incarnation": "another"}, tmp_path) == ""  # a newer learner: its own file will say
    (tmp_path / "learner.json").write_text(json.dumps({**record, "pid": os.getpid()}))
    assert _process_gone({"incarnation": "abc"}, tmp_path) == ""  # alive: the control
    (tmp_path / "learner.json").write_text(json.dumps({**record, "boot_id": "another machine"}))
    assert _process_gone({"incarnation": "abc"}, tmp_path) == ""  # not this machine's to judge
