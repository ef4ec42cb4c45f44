"""A rollout node's child processes die with it, however it dies (`kill -9` included).

vLLM's AsyncLLM always runs its engine core in a child process (`VLLM::EngineCore`), and vLLM
only stops it from a live parent: after a `kill -9` of the node the core is orphaned (parent 1),
keeps its memory (the GPU's, on a GPU) and ignores SIGTERM (FINDINGS.md, "Processes").

`children_die_with_me()` makes every multiprocessing child this process starts from then on watch
its parent: a daemon thread polls the parent's pid and SIGKILLs the child once the parent is gone
(reparented). The hook is inherited by forked children, so a child's own children watch it in
turn (a chain dies link by link). Spawned children (vLLM uses spawn when CUDA is initialised in the
parent) do not inherit it; `watch_parent()` arms the same watch from inside the child, and the
worker extension module (`rollout/backends/vllm_worker.py`) calls it when vLLM imports it there.

Why a polling thread and not `prctl(PR_SET_PDEATHSIG)`: the death signal fires when the *thread*
that forked the child ends, not the process, so an engine built in a worker thread (e.g. under
`asyncio.to_thread`) would lose its core when that thread is retired. multiprocessing's
`resource_tracker`, also left behind today, needs nothing: it exits once the last process holding
its pipe (the node and its engine core) is gone.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import signal
import threading
import time

POLL_S = 0.25  # how soon an orphan notices; a thread waking 4x a second costs nothing measurable

_watching = False  # this process already watches its parent
_registered = False  # this process's multiprocessing children will watch it


class _Hook:
    """The object multiprocessing's after-fork registry keeps (it holds its entries weakly)."""


_HOOK = _Hook()


def children_die_with_me() -> None:
    """From now on, every multiprocessing child of this process is SIGKILLed once this process is gone.

    Idempotent; call it before starting the children (the vLLM engine calls it before AsyncLLM).
    """
    global _registered
    if not _registered:
        multiprocessing.util.register_after_fork(_HOOK, _arm_in_child)
        _registered = True


def watch_parent(parent_pid: int | None = None, poll_s: float = POLL_S) -> bool:
    """Arm the watch in this process: SIGKILL itself once `parent_pid` (default: the multiprocessing
    parent) is no longer its parent. False, doing nothing, in a process without one (a main process)."""
    global _watching
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None else None
    if _watching or parent_pid is None:
        return False
    _watching = True
    threading.Thread(target=_watch, args=(parent_pid, poll_s), name="parent-watch", daemon=True).start()
    return True


def _arm_in_child(_hook: _Hook) -> None:
    global _watching
    _watching = False  # the flag was copied from the parent with its memory; this is a new process
    watch_parent()
    children_die_with_me()


def _watch(parent_pid: int, poll_s: float) -> None:
    # The parent pid was recorded by the parent itself, so a parent that died before this thread
    # started is seen at the first check (getppid is already 1 then).
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGKILL)
