"""engine/workers/lifeline.py with plain processes: a SIGKILLed parent's forked children, their children, and a
spawned child that armed its own watch all die with it; without the watch they outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

_PARENT = r"""
import multiprocessing, os, sys, time
from streamrl.engine.workers import lifeline

def grandchild():
    time.sleep(120)

def forked(ready):
    p = multiprocessing.get_context("fork").Process(target=grandchild)
    p.start()
    ready.send(p.pid)
    time.sleep(120)

def spawned(ready, watch):
    if watch:
        lifeline.watch_parent()  # what importing rollout/backends/vllm_worker.py does in a spawned vLLM process
    ready.send("armed")
    time.sleep(120)

if __name__ == "__main__":
    watch = sys.argv[1] == "watch"
    if watch:
        lifeline.children_die_with_me()
    inbox, ready = multiprocessing.Pipe(duplex=False)  # a pipe, not a Queue: no semaphore left by the kill
    a = multiprocessing.get_context("fork").Process(target=forked, args=(ready,))
    b = multiprocessing.get_context("spawn").Process(target=spawned, args=(ready, watch))
    a.start(); b.start()
    got = [inbox.recv(), inbox.recv()]
    grandchild_pid = next(x for x in got if isinstance(x, int))
    # Only this process writes to the pipe, in one write: three writers (children inherit stdout) under
    # PYTHONUNBUFFERED interleave their digits and newlines.
    os.write(1, f"{a.pid} {b.pid} {grandchild_pid}\n".encode())
    time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_parent_and_wait(folder, mode: str, wait_s: float) -> tuple[list[int], list[int]]:
    """Start the parent, SIGKILL it once it has three descendants; (descendants, those alive after `wait_s`)."""
    script = folder / "parent.py"  # a file, not -c: spawned children import their target from it
    script.write_text(_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in parent.stdout.readline().split()]  # sent once the spawned child watches
    assert len(pids) == 3, pids
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + wait_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:  # started by this test
        os.kill(pid, signal.SIGKILL)
    return pids, left


@pytest.mark.slow
def test_children_grandchildren_and_a_spawned_child_die_with_a_killed_parent(tmp_path):
    _, left = _kill_parent_and_wait(tmp_path, "watch", wait_s=3.0)
    assert left == []
    _, left = _kill_parent_and_wait(tmp_path, "none", wait_s=1.0)  # what the watch prevents
    assert len(left) == 3
