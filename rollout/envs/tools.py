"""A pool of tool worker processes with a deadline per call, awaited on the rollout node's event loop.

The rollout node holds one pool for all its episodes (`env.tools`, `env.tool_workers`); a tool
environment gets it as its `toolbox` argument. A call waits for an idle worker, then has
`env.tool_timeout_s`: past it the worker is killed and replaced, and the call returns a timeout
the model reads as the tool's answer. The processes themselves: `engine/workers/`. Why not
rewards/pool.py: a reward returns numbers for a batch, synchronously; a tool returns text for one
call, awaited among many episodes at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import msgspec

from streamrl.engine.messages import ToolCall, ToolReady, ToolStop
from streamrl.engine.workers.parent import WorkerProcess, context, stop_workers
from streamrl.rollout.envs import tool_worker

log = logging.getLogger(__name__)

BOOT_TIMEOUT_S = 120.0  # a worker imports the tool modules; generous on a loaded 2-core machine


class ToolPoolError(RuntimeError):
    """The pool cannot serve: workers fail to start. The message says why."""


@dataclasses.dataclass
class ToolOutcome:
    output: str = ""
    error: str = ""  # non-empty: the tool raised, is unknown, or timed out
    timed_out: bool = False

    @property
    def text(self) -> str:
        """What the model reads."""
        return f"error: {self.error}" if self.error else self.output


class _Worker(WorkerProcess):
    def __init__(self, ctx, specs: list[str]):
        super().__init__(ctx, tool_worker.main, (specs,), "streamrl-tool")

    def ready(self, timeout_s: float) -> ToolReady:
        if not self.conn.poll(timeout_s):
            self.kill()
            raise ToolPoolError(f"a tool worker did not start within {timeout_s:g} s")
        try:
            reply = tool_worker.decode_reply(self.conn.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError):
            self.kill()
            raise ToolPoolError(f"a tool worker exited while starting (code {self.proc.exitcode})") from None
        if not isinstance(reply, ToolReady) or reply.error:
            self.kill()
            raise ToolPoolError(f"a tool worker could not load its tools:\n{getattr(reply, 'error', reply)}")
        return reply


class ToolPool:
    """`workers` processes serving the tools `specs` names (registered names, `module:fn`, `path.py:fn`)."""

    def __init__(self, specs: list[str], workers: int = 1, timeout_s: float = 10.0, start_method: str = "forkserver"):
        if not specs:
            raise ValueError("a tool pool needs tools: set env.tools (e.g. ['calculator'])")
        self.specs, self.timeout_s = specs, timeout_s
        self.calls = self.timeouts = self.errors = self.restarts = 0
        self._ctx = context(start_method, "streamrl.rollout.envs.tool_worker")
        self._ids = 0
        self._workers = [_Worker(self._ctx, specs) for _ in range(workers)]
        try:
            readies = [w.ready(BOOT_TIMEOUT_S) for w in self._workers]
        except ToolPoolError:
            self.close()
            raise
        # OpenAI's function format, as chat templates take `tools=`
        self.schemas = [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in readies[0].tools
        ]
        self.names = [t.name for t in readies[0].tools]
        self._idle: asyncio.Queue[_Worker] | None = None  # made on first use, in the node's event loop
        self._booting: set[asyncio.Task] = set()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    async def call(self, name: str, arguments: dict) -> ToolOutcome:
        """Run tool `name` in a worker; a raise, an unknown name or a missed deadline is an outcome, not an error."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for w in self._workers:
                self._idle.put_nowait(w)
        worker = await self._idle.get()
        self.calls += 1
        try:
            outcome, healthy = await self._ask(worker, name, arguments)
        except BaseException:  # cancelled mid-call (the episode's deadline): the worker may still be busy
            self._retire(worker, "was left mid-call")
            raise
        if healthy:
            self._idle.put_nowait(worker)
        else:
            self._retire(worker, "timed out" if outcome.timed_out else "died")
        self.errors += bool(outcome.error) and not outcome.timed_out
        self.timeouts += outcome.timed_out
        return outcome

    async def _ask(self, worker: _Worker, name: str, arguments: dict) -> tuple[ToolOutcome, bool]:
        """One call on one worker: its outcome, and whether the worker can serve again."""
        self._ids += 1
        try:
            worker.conn.send_bytes(tool_worker.encode(ToolCall(call_id=self._ids, name=name, arguments=arguments)))
            if not await _readable(worker.conn, self.timeout_s):
                why = f"tool {name} did not answer within {self.timeout_s:g} s (env.tool_timeout_s); it was stopped"
                return ToolOutcome(error=why, timed_out=True), False
            reply = tool_worker.decode_reply(worker.conn.recv_bytes())
        except (EOFError, OSError, msgspec.DecodeError):
            return ToolOutcome(error=f"tool {name} crashed (its worker exited); it was restarted"), False
        return ToolOutcome(output=reply.output, error=reply.error), True

    def _retire(self, worker: _Worker, why: str) -> None:
        """Kill a worker and start its replacement, which joins the idle ones once it is ready."""
        log.warning("tool worker pid %d %s; replacing it", worker.proc.pid, why)
        worker.kill()
        fresh = _Worker(self._ctx, self.specs)
        self._workers[self._workers.index(worker)] = fresh
        self.restarts += 1
        task = asyncio.get_running_loop().create_task(self._when_ready(fresh))
        self._booting.add(task)
        task.add_done_callback(self._booting.discard)

    async def _when_ready(self, fresh: _Worker) -> None:
        try:
            await asyncio.to_thread(fresh.ready, BOOT_TIMEOUT_S)
        except ToolPoolError as e:  # the pool serves with one worker fewer; calls wait on the others
            log.error("a replacement tool worker failed: %s", e)
            return
        self._idle.put_nowait(fresh)

    def close(self) -> None:
        """Stop every worker: ask, then terminate, then kill, each with a bounded wait."""
        workers, self._workers = self._workers, []
        stop_workers(workers, tool_worker.encode(ToolStop()))


async def _readable(conn, timeout_s: float) -> bool:
    """Wait until the pipe has data (or EOF), without a thread; False at the deadline."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(True))
    try:
        await asyncio.wait_for(ready, timeout_s)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
