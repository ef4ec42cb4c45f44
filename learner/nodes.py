"""The rollout nodes as learner rank 0 sees them: registrations, heartbeats, departures, control messages.

One thread (`NodeRegistry`) owns the ZMQ ROUTER socket, since sockets are not thread-safe: it answers
`Register` with a `Welcome`, records heartbeats, routes `WeightsApplied` to whoever waits for them,
and sends what other threads queue with `send`. The registry is the one owner of "which nodes are
in the run": the orchestrator reads `events` (joined / left) and `forget`s an evicted node.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from streamrl.engine.messages import Goodbye, Heartbeat, Register, WeightsApplied, Welcome
from streamrl.engine.transport import ControlServer, TransportError

log = logging.getLogger("streamrl.learner")


@dataclasses.dataclass
class NodeInfo:
    peer: bytes
    host: str
    registered: float
    last_seen: float
    version: int = 0
    tokens_generated: int = 0
    generate_s: float = 0.0  # the node's own clock: seconds generating, idle, and paused for swaps
    idle_s: float = 0.0
    swap_s: float = 0.0


class NodeRegistry(threading.Thread):
    """Owns the control socket; `welcome()` builds each node's Welcome (the current version is asked
    of its owner at that moment, never copied)."""

    def __init__(self, server: ControlServer, welcome: Callable[[str], Welcome]):
        super().__init__(name="control", daemon=True)
        self.server, self.welcome = server, welcome
        self.nodes: dict[str, NodeInfo] = {}
        self.events: queue.Queue[tuple[str, str]] = queue.Queue()  # ("joined" | "left", node_id)
        self.applied: dict[str, queue.Queue[WeightsApplied]] = collections.defaultdict(queue.Queue)
        self.outbox: queue.Queue[tuple[str, object, concurrent.futures.Future, bool]] = queue.Queue()
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    @property
    def addr(self) -> str:
        return self.server.addr

    def run(self) -> None:
        while not self.stopping.is_set():
            self._flush_outbox()
            got = self.server.recv(0.02)
            if got is None:
                continue
            try:
                self._handle(*got)
            except TransportError as e:  # one node gone mid-handshake must not end this thread
                log.warning("control message %s from %r not answered: %s", type(got[1]).__name__, got[0], e)

    def _flush_outbox(self) -> None:
        while True:
            try:
                node_id, msg, done, then_forget = self.outbox.get_nowait()
            except queue.Empty:
                return
            info = self.nodes.get(node_id)
            try:
                if info is None:
                    raise TransportError(f"node {node_id!r} is not registered")
                self.server.send(info.peer, msg)
                done.set_result(None)
            except TransportError as e:
                log.warning("control message %s to %s not delivered: %s", type(msg).__name__, node_id, e)
                done.set_exception(e)
            if then_forget:
                self.forget(node_id)

    def _handle(self, peer: bytes, msg) -> None:
        now = time.time()
        if isinstance(msg, Register):
            with self.lock:
                self.nodes[msg.node_id] = NodeInfo(peer, msg.host, now, now)
            self.server.send(peer, self.welcome(msg.node_id))
            self.events.put(("joined", msg.node_id))
        elif isinstance(msg, Heartbeat) and msg.node_id in self.nodes:
            info = self.nodes[msg.node_id]
            info.last_seen, info.version, info.tokens_generated = now, msg.policy_version, msg.tokens_generated
            info.generate_s, info.idle_s, info.swap_s = msg.generate_s, msg.idle_s, msg.swap_s
        elif isinstance(msg, WeightsApplied):
            self.applied[msg.node_id].put(msg)
        elif isinstance(msg, Goodbye):
            log.info("node %s left: %s", msg.node_id, msg.reason)
            self.events.put(("left", msg.node_id))

    def send(self, node_id: str, msg, then_forget: bool = False) -> concurrent.futures.Future:
        """Queue `msg` for the node; the future fails when it could not be delivered (node gone).
        `then_forget`: the node leaves the registry once the message left (or could not)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.outbox.put((node_id, msg, done, then_forget))
        return done

    def take_events(self) -> list[tuple[str, str]]:
        """Joins and departures since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def reset(self, node_id: str) -> None:
        """A (re)joining node: an old process's late WeightsApplied must not be taken for its answer."""
        self.applied.pop(node_id, None)

    def take_applied(self, node_id: str) -> WeightsApplied | None:
        """The node's next confirmation, if one came; never waits."""
        try:
            return self.applied[node_id].get_nowait()
        except queue.Empty:
            return None

    def forget(self, node_id: str) -> None:
        with self.lock:
            self.nodes.pop(node_id, None)

    def close(self) -> None:
        self.stopping.set()
        self.join(timeout=5.0)
        self.server.close()
