"""A vLLM node's place in the relay tree (learner/relay_tree.py): it forwards each version it receives to the nodes
the learner gives it, as an sim or hf node does (engine/weights/relay.py), though its receiver runs in vLLM's
worker, a process of its own on a GPU (the engine core's), the node's own on CPU without multiprocessing.

So the relay lives where the version lands: `RelayInWorker` (mixed into `WeightReceiverExtension`) holds a
`Relay` on the worker's stager; its copy of each version and its sends to children are the worker's, on the
worker's device (NCCL from GPU memory, gloo from host memory), and nothing of the weights crosses into the node's
process. The node keeps `WorkerRelay`, which answers what the control thread asks of a relay (`assign`, `close`,
`expect`) by calling the worker (`collective_rpc`), and fetches the layouts the worker made for its children (a
`WeightsReady` naming the worker's store for each) from the worker's outbox, for the control thread to send the
learner as `Relayed`.

The worker cannot call the node: the node asks. It asks at once and then often (every FAST_S) only while a layout
is due: after a version arrived for it to receive (`expect`, until every child had a layout of that version or the
version's deadline passed) and just after the learner changed its children (ASSIGN_HOT_S); else every SLOW_S, so
that a layout made between those times waits at most that long. A layout that waits costs the child
that much of its deadline, which starts when the learner hands the layout on, not when the worker made it.

Only worker rank 0 relays (a vLLM node here runs one worker: no tensor parallelism).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from streamrl.engine import messages
from streamrl.engine.messages import WeightsReady
from streamrl.engine.weights.relay import Relay

log = logging.getLogger("streamrl.rollout")

FAST_S = 0.02  # the node asks its worker for layouts this often while one is due
SLOW_S = 0.25  # and this often otherwise, while it relays
ASSIGN_HOT_S = 2.0  # a new child is sent the copy the worker holds at once: fast asks for this long after a RelayTo


class RelayInWorker:
    """The worker's half: `WeightReceiverExtension` inherits it (it provides `_staging`). Each method returns a
    plain dict and never raises into the engine core."""

    def relay_assign(self, node_id: str, children: list[str], versions: list[int]) -> dict:
        """The learner's list of this node's children (`RelayTo`): the worker's relay is made on the first."""
        if int(getattr(self, "rank", 0)) != 0:
            return {"relays": False, "error": ""}
        try:
            self._worker_relay(node_id).assign(list(children), list(versions))
            return {"relays": True, "error": ""}
        except Exception as e:  # noqa: BLE001 - reported to the node, which logs it; the learner re-parents
            return {"relays": False, "error": f"{type(e).__name__}: {e}"}

    def relay_outbox(self) -> dict:
        """The layouts made for children since the last call: (child, encoded `WeightsReady`) pairs."""
        state = self._staging()
        with state["lock"]:
            out, state["outbox"] = state.get("outbox", []), []
        return {"relayed": out}

    def relay_close(self) -> dict:
        """The node stops: no child is served any more."""
        relay = self._staging().get("relay")
        if relay is not None:
            relay.close()
        return {"closed": relay is not None}

    def _worker_relay(self, node_id: str) -> Relay:
        state = self._staging()
        if state.get("relay") is None:

            def announce(child: str, ready: WeightsReady) -> None:
                with state["lock"]:
                    state.setdefault("outbox", []).append((child, messages.encode(ready)))

            state["relay"] = state["stager"].relay = Relay(node_id, announce)
        return state["relay"]


class WorkerRelay:
    """The node's half: what rollout/control.py calls on a relay, done in the worker; the worker's layouts for
    children go to `announce(child, ready)` (the control thread's queue of `Relayed`)."""

    def __init__(self, engine, node_id: str, announce: Callable[[str, WeightsReady], None],
                 loop: asyncio.AbstractEventLoop):  # fmt: skip
        """engine: the vLLM engine (`collective_rpc`); loop: the node's event loop, where every call runs."""
        self.engine, self.node_id, self.announce, self.loop = engine, node_id, announce, loop
        self._lock = threading.Lock()  # the control thread writes what the poll reads
        self._children: list[str] = []
        self._due: tuple[int, float] | None = None  # a version whose layouts are due, and until when
        self._announced: dict[str, int] = {}  # the newest version each child was given a layout of
        self._hot_until = 0.0
        self._poll: asyncio.Future | None = None
        self._wake = asyncio.Event()  # set on the loop: ask the worker now (a layout became due)
        self._closed = False

    def assign(self, children: list[str], versions: list[int]) -> None:
        """From the control thread: the worker is told (in order, on the node's loop), then asked often a while."""
        with self._lock:
            self._children = list(children)
            self._hot_until = time.monotonic() + ASSIGN_HOT_S
        asyncio.run_coroutine_threadsafe(self._assign(list(children), list(versions)), self.loop)

    def expect(self, ready: WeightsReady) -> None:
        """From the control thread: a version the worker is about to receive; each child is due a layout of it
        (the poll, if waiting its slow turn, asks at once and then often)."""
        with self._lock:
            self._due = (ready.version, time.monotonic() + ready.timeout_s)
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake.set)

    def children(self) -> list[str]:
        with self._lock:
            return list(self._children)

    def close(self) -> None:
        """The node stops: the polling ends and the worker serves no child (its engine may be gone already)."""
        if self._closed:
            return
        self._closed = True
        if not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._close(), self.loop)

    async def _assign(self, children: list[str], versions: list[int]) -> None:
        if self._closed:
            return
        try:
            results = await self.engine.collective_rpc("relay_assign", args=(self.node_id, children, versions))
        except Exception as e:  # noqa: BLE001 - the children time out and the learner re-parents them
            results = [{"error": f"{type(e).__name__}: {e}"}]
        errors = [r["error"] for r in results if r.get("error")]
        if errors:
            log.warning("node %s could not relay to %s: %s", self.node_id, ", ".join(children), errors[0])
        else:  # the worker's own line goes to its process's log, which a GPU node's console may not show
            log.info("node %s relays weights to %d nodes (from its worker): %s", self.node_id, len(children),
                     ", ".join(children))  # fmt: skip
        if self._poll is None:
            self._poll = asyncio.ensure_future(self._polling())
        self._wake.set()  # a new child is sent the copy the worker holds at once: its layout is due now

    async def _close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
        try:
            await self.engine.collective_rpc("relay_close")
        except Exception as e:  # noqa: BLE001 - the engine closed first: nothing is served any more anyway
            log.debug("relay_close: %s: %s", type(e).__name__, e)

    async def _polling(self) -> None:
        failing = False
        while not self._closed:
            try:
                await asyncio.wait_for(self._wake.wait(), FAST_S if self._hot() else SLOW_S)
            except TimeoutError:
                pass
            self._wake.clear()
            if self._closed:
                return
            try:
                results = await self.engine.collective_rpc("relay_outbox")
            except Exception as e:  # noqa: BLE001 - once, not every poll; the learner re-parents the children
                if not failing:
                    log.warning("node %s: its worker's relay did not answer: %s: %s", self.node_id, type(e).__name__, e)
                failing = True
                continue
            failing = False
            for result in results:
                for child, ready_bytes in result.get("relayed", []):
                    self._hand_on(child, messages.decode_control(ready_bytes))

    def _hand_on(self, child: str, ready: WeightsReady) -> None:
        with self._lock:
            self._announced[child] = max(ready.version, self._announced.get(child, -1))
        self.announce(child, ready)

    def _hot(self) -> bool:
        """Whether a layout is due: a version not yet laid out for every child (before its deadline), or a
        RelayTo just now."""
        now = time.monotonic()
        with self._lock:
            if self._due is not None:
                version, until = self._due
                if now > until or all(self._announced.get(c, -1) >= version for c in self._children):
                    self._due = None
            return self._due is not None or now < self._hot_until
