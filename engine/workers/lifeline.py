"""Child processes die with their parent, however it dies (`kill -9` included): the one mechanism.

A child watches its parent from a daemon thread and SIGKILLs itself once the parent is gone. Who
arms it:
- a worker's serve loop (`engine/workers/child.py`: reward and tool workers): a worker stuck in a
  hung call never reads its pipe, so without the watch it would outlive a SIGKILLed parent;
- every multiprocessing child of a process that called `children_die_with_me()` (the rollout node
  before building vLLM's AsyncLLM): vLLM's engine core (`VLLM::EngineCore`) is only stopped by a
  live parent; after a `kill -9` of the node it is orphaned, keeps its memory (the GPU's, on a GPU)
  and ignores SIGTERM (FINDINGS.md, "Processes"). The hook is inherited by forked children, so a
  chain dies link by link; a spawned child does not inherit it, and `watch_parent()` arms the same
  watch from inside it (`rollout/backends/vllm_worker.py` does when vLLM imports it there).

The parent's death is read from multiprocessing's parent sentinel, which becomes ready the moment
the parent is gone whatever the start method (under forkserver the OS parent is the fork server,
which outlives the pool); a process given only a pid polls its parent pid.

Why a watching thread and not `prctl(PR_SET_PDEATHSIG)`: the death signal fires when the *thread*
that forked the child ends, not the process, so an engine built in a worker thread (e.g. under
`asyncio.to_thread`) would lose its core when that thread is retired. A program that is exec'd
(`redis-server`) has no Python to run the watch: `exec_dies_with_me` is its `preexec_fn` and uses
the death signal, so start such a child from a thread that lives as long as it should.
`resource_tracker` needs nothing: it exits once the last process holding its pipe is gone.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import sys
import threading
import time

POLL_S = 0.25  # how soon an orphan given only a pid notices; a thread waking 4x a second costs nothing

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
    """Arm the watch in this process: SIGKILL itself once its parent is gone (default: the multiprocessing
    parent; `parent_pid`: once that pid is no longer its parent). False, doing nothing, in a process
    without one (a main process) or one that watches already."""
    global _watching
    parent = multiprocessing.parent_process() if parent_pid is None else None
    if _watching or (parent is None and parent_pid is None):
        return False
    _watching = True
    if parent is not None:
        target, args = _wait_sentinel, (parent,)
    else:
        target, args = _poll_pid, (parent_pid, poll_s)
    threading.Thread(target=target, args=args, name="parent-watch", daemon=True).start()
    return True


def exec_dies_with_me() -> None:
    """`preexec_fn` for an exec'd child (no Python there to watch): SIGTERM it when the parent dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _arm_in_child(_hook: _Hook) -> None:
    global _watching
    _watching = False  # the flag was copied from the parent with its memory; this is a new process
    watch_parent()
    children_die_with_me()


def _wait_sentinel(parent) -> None:
    # ready once the parent is gone, also if it went before this thread started; imported above, as an
    # import in this thread would race the main thread's own import of the module
    multiprocessing.connection.wait([parent.sentinel])
    os.kill(os.getpid(), signal.SIGKILL)


def _poll_pid(parent_pid: int, poll_s: float) -> None:
    # The parent pid was recorded by the parent itself, so a parent that died before this thread
    # started is seen at the first check (getppid is already 1 then).
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGKILL)
