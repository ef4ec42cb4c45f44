"""One owner per run folder (ops/lock.py), on real processes and the kernel's flock: a second owner is refused
while the first lives, a killed owner leaves no stale lock, a hold handed to a child is shared, and probing
(`holder`) neither makes nor writes the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from streamrl.ops.lock import LOCK_FILE, OWNER_FD, RunBusyError, RunOwner, holder

# A process that takes the folder's lock, says so on stdout, and holds it until its stdin closes.
_HOLD = textwrap.dedent("""
    import pathlib, sys
    from streamrl.ops.lock import RunOwner, take_or_inherit
    owner = take_or_inherit(pathlib.Path(sys.argv[1]))
    print("held", flush=True)
    sys.stdin.read()
""")


def _holder_process(run_dir, env=None, pass_fds=()):
    process = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env, pass_fds=pass_fds)  # fmt: skip
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_owner_is_refused_while_the_first_lives_and_free_once_it_is_killed(tmp_path):
    run_dir = tmp_path / "run"
    first = _holder_process(run_dir)
    try:
        said = holder(run_dir)
        assert said is not None and said["pid"] == first.pid and said["command"].startswith("streamrl")
        with pytest.raises(RunBusyError) as refused:
            RunOwner.take(run_dir, "streamrl run second")
        text = str(refused.value)
        assert f"pid {first.pid}" in text and "streamrl status --run run" in text and "run.name=" in text
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == first.pid  # the refused one wrote nothing
    finally:
        first.kill()  # SIGKILL: no clean-up of its own; the kernel ends the lock
        first.wait()
    assert holder(run_dir) is None
    owner = RunOwner.take(run_dir, "streamrl run third")  # the positive control: free again
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    owner.release()
    assert holder(run_dir) is None


def test_a_hold_handed_to_a_child_is_shared_and_outlives_its_giver(tmp_path):
    run_dir = tmp_path / "run"
    owner = RunOwner.take(run_dir, "streamrl run")
    env, fds = owner.handed()
    child = _holder_process(run_dir, env={**os.environ, **env}, pass_fds=fds)  # takes it through OWNER_FD
    try:
        os.close(owner.fd)  # as if the launcher died: the learner it handed the hold to still owns the folder
        owner.fd = -1
        assert holder(run_dir) is not None
        with pytest.raises(RunBusyError):
            RunOwner.take(run_dir)
    finally:
        child.kill()
        child.wait()
    assert holder(run_dir) is None


def test_an_unrelated_descriptor_in_the_environment_is_not_a_hold(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text("")
    with open(tmp_path / "other", "w") as other:
        monkeypatch.setenv(OWNER_FD, str(other.fileno()))
        assert RunOwner.inherited(run_dir) is None  # another file's descriptor: this process must take it


def test_probing_a_folder_without_an_owner_makes_nothing(tmp_path):
    assert holder(tmp_path / "none") is None
    assert not (tmp_path / "none").exists()
