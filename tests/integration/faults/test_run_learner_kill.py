"""The learner `kill -9` under `streamrl run`: the run says it stopped without an ending. The launcher
exits 137 (128 + the signal, as a shell reports it), writes RUN/end.json for the learner that could not
(`stopped without an ending: learner killed (signal 9, SIGKILL)`), and `streamrl status` says so; with no
end.json at all (a learner killed with its launcher), status says the learner's process is gone, never
`running`. The books balance, the samples in flight left for a resume.

One run, read by each test; hf nodes, as in test_run_replacement.py.
"""

from __future__ import annotations

import json
import re
import time

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.slow]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, fault_tools):
    folder = tmp_path_factory.mktemp("learner_kill")
    run = fault_tools.CliRun(folder, "killed", [*fault_tools.run_settings, "rollout.backend='hf'", "run.steps=1000"])
    try:
        run.wait(lambda: len(run.records()) >= 2, "2 steps")
        [learner] = run.pids("streamrl learner")
        status_before = run.status()  # while it runs: the control of "never running once it is gone"
        fault_tools.kill(learner)
        killed_at = time.time()
        code = run.finish(600)
        exit_s = time.time() - killed_at
    finally:
        run.close()
    ending = json.loads((run.run_dir / "end.json").read_text())
    status = run.status()
    (run.run_dir / "end.json").unlink()  # as if the launcher had died with it: the ledger alone must tell
    status_without_ending = run.status(named=False)  # also: a run found without its name (the only one here)
    fault_tools.figure("run_learner_kill9", exit_code=code, exit_s=round(exit_s, 1), ended=ending["ended"],
                       status=_row(status.stdout, "run"))  # fmt: skip
    return dict(code=code, said=run.said(), ending=ending, before=status_before, status=status,
                without=status_without_ending)  # fmt: skip


def _row(text: str, name: str) -> str:
    """The value of `streamrl status`'s row `name`."""
    found = re.search(rf"│ {name} +│ +(.*?) +│", text)
    return found.group(1) if found else ""


def test_the_launcher_exits_137_and_names_the_kill(killed):
    assert killed["code"] == 137, killed["said"][-3000:]
    assert "the learner exited (killed by signal 9" in killed["said"] and "Traceback" not in killed["said"]


def test_end_json_is_written_by_the_launcher_for_the_killed_learner(killed):
    ending = killed["ending"]
    assert (ending["ended"], ending["exit"], ending["by"]) == ("stopped without an ending", 137, "launcher")
    assert ending["detail"].startswith("learner killed (signal 9, SIGKILL)")


def test_status_names_the_kill_and_the_books_balance(killed):
    before, status = killed["before"], killed["status"]
    assert before.returncode == 0 and _row(before.stdout, "run") == "running", before.stdout + before.stderr
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.fullmatch(r"stopped without an ending [-\d: ]+: learner killed \(signal 9, SIGKILL\).*\(exit 137\)",
                        _row(status.stdout, "run")), status.stdout  # fmt: skip
    assert "books balance" in status.stdout


def test_without_end_json_status_says_the_learner_heartbeat_is_gone(killed):
    without = killed["without"]
    assert without.returncode == 0, without.stdout + without.stderr
    assert "run killed (the newest in " in without.stderr  # found without --run, and said which
    # the learner ran on this machine (RUN/learner.json): its process is seen gone even while its heartbeat has not
    # lapsed yet (a TTL after its last beat), which the ledger alone would still call running
    assert re.fullmatch(r"stopped without an ending: the learner process \d+ is gone; its last heartbeat [-\d: ]+",
                        _row(without.stdout, "run")), without.stdout  # fmt: skip
