"""A pool of reward worker processes with a deadline per call.

`RewardPool.run` splits a batch into one chunk per worker for each pool-run reward, sends the
chunks to idle workers and waits on their pipes. A call past `reward.timeout_s` has its worker
killed and replaced and its samples get None (counted as timeouts); a worker that dies mid-call
gives None (counted as errors). The processes themselves: `engine/workers/`.
"""

from __future__ import annotations

import collections
import time
from multiprocessing.connection import wait

import msgspec

from streamrl.engine.config import RewardConfig
from streamrl.engine.messages import RewardCall, RewardReady, RewardStop
from streamrl.engine.workers.parent import WorkerProcess, context, stop_workers

from . import worker as worker_module
from .call import Batch, CallOutcome

BOOT_TIMEOUT_S = 120.0  # a worker imports the reward modules; generous on a loaded 2-core machine
MAX_BOOT_FAILURES = 3


class RewardPoolError(RuntimeError):
    """The pool cannot serve: workers fail to start. The message says why."""


class _Worker(WorkerProcess):
    def __init__(self, ctx, cfg_bytes: bytes, specs: list[str]):
        super().__init__(ctx, worker_module.main, (cfg_bytes, specs), "streamrl-reward")
        self.ready = False
        self.task: int | None = None  # index into the current run's tasks
        self.deadline = 0.0


class RewardPool:
    """`cfg.workers` reward processes serving `specs` (indices into it name the function per call)."""

    def __init__(self, specs: list[str], cfg: RewardConfig):
        if cfg.workers < 1:
            raise ValueError(f"reward.workers = {cfg.workers}: a pool needs at least 1 worker")
        self.specs = specs
        self.timeout_s = cfg.timeout_s
        self.restarts = 0
        self._boot_failures = 0
        self._cfg_bytes = msgspec.msgpack.encode(cfg)
        self._ctx = context(cfg.start_method, "streamrl.rewards.worker")
        self._next_call = 0
        self.workers = [self._spawn() for _ in range(cfg.workers)]

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self._cfg_bytes, self.specs)

    def run(self, fn_indices: list[int], batch: Batch) -> list[CallOutcome]:
        """One outcome per entry of `fn_indices`: that function's values over the whole batch."""
        if not self.workers:
            raise RewardPoolError("the reward pool is closed; build a new scorer")
        n = len(batch)
        size = -(-n // len(self.workers)) if n else 1
        tasks = [(fn, start, min(n, start + size)) for fn in fn_indices for start in range(0, n, size)]
        results = self._run_tasks(tasks, batch)
        outcomes = []
        for fn in fn_indices:
            parts = [r for (f, _, _), r in zip(tasks, results) if f == fn]
            outcomes.append(
                CallOutcome(
                    values=[v for p in parts for v in p.values],
                    errors=sum(p.errors for p in parts),
                    timeouts=sum(p.timeouts for p in parts),
                    traceback=next((p.traceback for p in parts if p.traceback), ""),
                    fell_back=any(p.fell_back for p in parts),
                )
            )
        return outcomes

    def _run_tasks(self, tasks: list[tuple[int, int, int]], batch: Batch) -> list[CallOutcome]:
        results: list[CallOutcome | None] = [None] * len(tasks)
        pending = collections.deque(range(len(tasks)))
        while pending or any(w.task is not None for w in self.workers):
            self._dispatch(pending, tasks, batch)
            waiting = [w for w in self.workers if not w.ready or w.task is not None]
            for conn in wait([w.conn for w in waiting], timeout=self._wait_s(waiting)):
                self._receive(next(w for w in waiting if w.conn is conn), tasks, results)
            self._expire(tasks, results)
        return results

    def _dispatch(self, pending: collections.deque, tasks, batch: Batch) -> None:
        for w in self.workers:
            if not pending:
                return
            if w.ready and w.task is None:
                w.task = pending.popleft()
                fn, start, stop = tasks[w.task]
                part = batch.take(start, stop)
                self._next_call += 1
                call = worker_module.encode_call(
                    RewardCall(
                        call_id=self._next_call,
                        fn_index=fn,
                        prompts=part.prompts,
                        completions=part.completions,
                        completion_ids=part.completion_ids,
                        columns=part.columns,
                    )
                )
                try:
                    w.conn.send_bytes(call)
                except OSError:  # it died while idle (OOM killer, a stray signal): retry on its replacement
                    pending.appendleft(w.task)
                    w.task = None
                    w.kill()
                    self._replace(w)
                    continue
                w.deadline = time.monotonic() + self.timeout_s

    def _wait_s(self, waiting: list[_Worker]) -> float:
        now = time.monotonic()
        ends = [w.deadline if w.ready else w.started + BOOT_TIMEOUT_S for w in waiting]
        return max(0.0, min(ends, default=now + 1.0) - now) + 0.001

    def _receive(self, w: _Worker, tasks, results: list) -> None:
        try:
            reply = worker_module.decode_reply(w.conn.recv_bytes())
        except (EOFError, OSError):
            self._died(w, tasks, results)
            return
        if isinstance(reply, RewardReady):
            if reply.error:
                self.close()
                raise RewardPoolError(f"a reward worker could not load reward.functions {self.specs}:\n{reply.error}")
            w.ready = True
            self._boot_failures = 0
            return
        results[w.task] = CallOutcome(
            values=reply.values, errors=reply.errors, traceback=reply.traceback, fell_back=reply.fell_back
        )
        w.task = None

    def _died(self, w: _Worker, tasks, results: list) -> None:
        w.proc.join(timeout=5)
        code = w.proc.exitcode
        if w.task is not None:
            fn, start, stop = tasks[w.task]
            results[w.task] = CallOutcome(
                values=[None] * (stop - start),
                errors=stop - start,
                traceback=f"reward worker pid {w.proc.pid} exited (code {code}) while scoring "
                f"{self.specs[fn]!r} on {stop - start} samples; it was replaced",
            )
        elif not w.ready:
            self._boot_failures += 1
            if self._boot_failures >= MAX_BOOT_FAILURES:
                self.close()
                raise RewardPoolError(
                    f"reward workers exited before becoming ready {MAX_BOOT_FAILURES} times "
                    f"in a row (last exit code {code}); see their stderr above. A script that builds a scorer "
                    "must guard its entry point with `if __name__ == '__main__':` (workers "
                    "re-import the main module)"
                )
        self._replace(w)

    def _expire(self, tasks, results: list) -> None:
        now = time.monotonic()
        for w in list(self.workers):
            if w.task is not None and now > w.deadline:
                fn, start, stop = tasks[w.task]
                results[w.task] = CallOutcome(
                    values=[None] * (stop - start),
                    timeouts=stop - start,
                    traceback=f"reward {self.specs[fn]!r} on {stop - start} samples passed its "
                    f"{self.timeout_s:g} s deadline (reward.timeout_s); worker pid {w.proc.pid} "
                    "was killed and replaced",
                )
                w.kill()
                self._replace(w)
            elif not w.ready and now > w.started + BOOT_TIMEOUT_S:
                self.close()
                raise RewardPoolError(f"a reward worker did not start within {BOOT_TIMEOUT_S:g} s")

    def _replace(self, w: _Worker) -> None:
        if not w.conn.closed:
            w.conn.close()
        self.workers[self.workers.index(w)] = self._spawn()
        self.restarts += 1

    def close(self) -> None:
        """Stop every worker: ask, then terminate, then kill, each with a bounded wait."""
        workers, self.workers = self.workers, []
        stop_workers(workers, worker_module.encode_call(RewardStop()))
