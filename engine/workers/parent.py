"""The pool's side: start a worker process with its pipe, and stop a pool's workers.

Workers start with forkserver or spawn, never fork: the processes that hold pools (the rollout
node) run vLLM's threads, and a forked copy of them can deadlock.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterable

STOP_GRACE_S = 2.0  # how long a worker asked to stop has, then as long again after SIGTERM


def context(start_method: str, preload: str):
    """The multiprocessing context for workers; under forkserver, `preload` (the worker module) is
    imported once in the fork server."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload([preload])
    return ctx


class WorkerProcess:
    """One worker process and the pool's end of its pipe; `target(conn, *args)` runs in the child."""

    def __init__(self, ctx, target: Callable, args: tuple, name: str):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.proc.start()
        child.close()  # so a dead worker shows as EOF on our end
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def stop_workers(workers: Iterable[WorkerProcess], stop_frame: bytes, grace_s: float = STOP_GRACE_S) -> None:
    """Stop every worker: ask (`stop_frame`), then terminate, then kill, each with a bounded wait."""
    workers = list(workers)
    for w in workers:
        try:
            w.conn.send_bytes(stop_frame)
        except (OSError, ValueError):
            pass  # gone already, or its pipe closed
    deadline = time.monotonic() + grace_s
    for w in workers:
        w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if w.proc.is_alive():
            w.proc.terminate()
            w.proc.join(timeout=grace_s)
        if w.proc.is_alive():
            w.kill()
        elif not w.conn.closed:
            w.conn.close()
