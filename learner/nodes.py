"""The rollout nodes as learner rank 0 sees them: registrations, heartbeats, departures, control messages.

One thread (`NodeRegistry`) owns the ZMQ ROUTER socket, since sockets are not thread-safe: it answers
`Register` with a `Welcome`, records heartbeats, routes `WeightsApplied` to whoever waits for them,
and sends what other threads queue with `send`. The registry is the one owner of "which nodes are
in the run": a node joins by registering; it leaves (`leave`, after its Goodbye), is evicted
(`evict`, for the publisher's report of a failed transfer) or is lost (`lost`, reaped by the ledger)
only through the registry, which tells it `Stop` where it can and writes each change to the run's
events (`RUN/events.jsonl`, the live view's roster). Others ask it: `count`, `nodes`, `take_events`.
What another part keeps per node hangs on the node's entry (`attach`: the publisher's weights link) and
is closed by the registry when the node leaves, however it leaves: no second roster to keep in step.

It is also the one owner of who a node is (`identity`): a node id is bound to the CURVE key that
first registered it (for the whole run: a different key cannot take the id over, even after the
node left) and to a secret made at each registration and sent in its `Welcome`, which signs its
trajectory frames. Without CURVE (turned off by the user) there is no key: a live id is never
registered again, so a local process cannot take a node's place. A control message is taken only
from the peer and key that registered its node; anything else is counted on the control socket's
tally (`unregistered`, `spoofed`) and ignored.

Which of its nodes can no longer be reached (a connection closed, a node silent past a beat) is asked of
`Reachability` (learner/reachability.py), which the registry tells of each registration, goodbye and departure.
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
from typing import Protocol

from streamrl.engine.auth import Identity, new_secret
from streamrl.engine.control import ControlServer
from streamrl.engine.messages import Goodbye, Heartbeat, Register, Relayed, Stop, WeightsApplied, Welcome
from streamrl.engine.telemetry import EventLog
from streamrl.engine.transport import TransportError
from streamrl.engine.weights.paths import Location
from streamrl.learner.reachability import Reachability

log = logging.getLogger("streamrl.learner")


@dataclasses.dataclass
class NodeInfo:
    peer: bytes
    host: str
    registered: float
    last_seen: float
    key: str = ""  # the CURVE key it registered with ('' without CURVE)
    version: int = 0
    tokens_generated: int = 0
    generate_s: float = 0.0  # the node's own clock: seconds generating, idle, and paused for swaps
    idle_s: float = 0.0
    swap_s: float = 0.0
    peak_gib: float = 0.0  # its peak CUDA memory, as it reported
    where: Location | None = None  # machine and device, as it registered: picks its weights' path
    relays: bool = False  # it can forward versions to other nodes (Register.relays)
    link: Link | None = None  # its weights' link (the publisher's), closed when the node leaves the run


class Link(Protocol):
    """What another part keeps for one node (the publisher's `_Link`): closed when the node leaves."""

    def close(self) -> None: ...


class NodeRegistry(threading.Thread):
    """Owns the control socket; `welcome()` builds each node's Welcome (the current version is asked
    of its owner at that moment, never copied)."""

    def __init__(self, server: ControlServer, welcome: Callable[[str], Welcome], events: EventLog | None = None):
        super().__init__(name="control", daemon=True)
        self.server, self.welcome, self.run_events = server, welcome, events
        self.evicted = 0  # nodes evicted so far
        self.nodes: dict[str, NodeInfo] = {}
        self.identities: dict[str, Identity] = {}  # kept after a node leaves: its id stays bound to its key
        self.departed: dict[str, tuple[bytes, str]] = {}  # connection and key of nodes that left
        self.reachability = Reachability(server, self.silent_s)  # which nodes went silent or closed their connection
        self.events: queue.Queue[tuple[str, str]] = queue.Queue()  # ("joined" | "left", node_id)
        self.applied: dict[str, queue.Queue[WeightsApplied]] = collections.defaultdict(queue.Queue)
        self.outbox: queue.Queue[tuple[str, object, concurrent.futures.Future, bool, bool]] = queue.Queue()
        self._relayed: Callable[[Relayed], None] = lambda msg: None  # the publisher's relay tree hands these on
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    @property
    def addr(self) -> str:
        return self.server.addr

    def run(self) -> None:
        while not self.stopping.is_set():
            self._flush_outbox()
            self.reachability.check(self.nodes)
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
                node_id, msg, done, then_forget, resolved = self.outbox.get_nowait()
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
                self.reachability.probe(node_id, info)  # its connection may be gone: known before the node is forgotten
                done.set_exception(e)
            if then_forget:
                self.forget(node_id, resolved)

    def identity(self, node_id: str) -> Identity | None:
        """What the node's frames must prove (its key and secret); None for an id never registered."""
        with self.lock:
            return self.identities.get(node_id)

    def _handle(self, peer: bytes, msg, key: str = "") -> None:
        if isinstance(msg, Register):
            self._register(peer, msg, key)
            return
        if not isinstance(msg, (Heartbeat, WeightsApplied, Goodbye, Relayed)):  # what only the learner sends
            self.server.faults.add(f"peer {peer!r}", "unexpected", detail=type(msg).__name__)
            return
        if not self._speaks_for(peer, key, msg):
            return
        now = time.time()
        self.reachability.heard(msg.node_id, peer)
        if isinstance(msg, Heartbeat):
            info = self.nodes[msg.node_id]
            info.last_seen, info.version, info.tokens_generated = now, msg.policy_version, msg.tokens_generated
            info.generate_s, info.idle_s, info.swap_s = msg.generate_s, msg.idle_s, msg.swap_s
            info.peak_gib = msg.peak_gib
        elif isinstance(msg, WeightsApplied):
            self.applied[msg.node_id].put(msg)
        elif isinstance(msg, Relayed):
            self._relayed(msg)  # queues the child's WeightsReady: out at this thread's next turn
        elif isinstance(msg, Goodbye):
            log.info("node %s left: %s", msg.node_id, msg.reason)
            self.reachability.said_goodbye(msg.node_id)
            self.events.put(("left", msg.node_id))

    def _register(self, peer: bytes, msg: Register, key: str) -> None:
        bound = self.identity(msg.node_id)
        if bound is not None and bound.key != key:
            self._refuse(peer, msg, "spoofed", "the id is bound to another key")
            self.server.send(peer, Stop(reason=f"node id {msg.node_id!r} is registered under another key"))
            return
        if bound is not None and not key and msg.node_id in self.nodes:
            # Without CURVE no key proves that the newcomer is the node: a live id is never handed over.
            self._refuse(peer, msg, "spoofed", "the id is live and there is no key to prove it")
            self.server.send(peer, Stop(reason=f"node id {msg.node_id!r} is live in this run (no CURVE key)"))
            return
        now, identity = time.time(), Identity(key, new_secret())
        self.reachability.registered(msg.node_id)
        with self.lock:
            self.identities[msg.node_id] = identity
            where = Location(host=msg.host, boot_id=msg.boot_id, device=msg.device, gpu_uuid=msg.gpu_uuid)
            before = self.nodes.get(msg.node_id)  # a node back under its id: its old process's link ends
            self.nodes[msg.node_id] = NodeInfo(peer, msg.host, now, now, key, where=where, relays=msg.relays)
        if before is not None and before.link is not None:
            before.link.close()
        welcome = self.welcome(msg.node_id)
        welcome.secret = identity.secret
        self.server.send(peer, welcome)
        self.events.put(("joined", msg.node_id))
        self._record("node_joined", msg.node_id)

    def _speaks_for(self, peer: bytes, key: str, msg) -> bool:
        """The message comes from the connection and key that registered the node it names. A late
        message from a node that left (or was evicted), from its own connection, is dropped uncounted."""
        info = self.nodes.get(msg.node_id)
        if info is not None and (info.peer, info.key) == (peer, key):
            return True
        if info is not None:
            self._refuse(peer, msg, "spoofed", "sent by another peer or key than the node's")
        elif self.departed.get(msg.node_id) != (peer, key):
            self._refuse(peer, msg, "unregistered", "no such node in the run")
        return False

    def _refuse(self, peer: bytes, msg, kind: str, why: str) -> None:
        detail = f"{type(msg).__name__} from peer {peer!r}: {why}"
        self.server.faults.add(f"node {msg.node_id!r} (claimed)", kind, detail=detail)

    def refused(self) -> int:
        """Control messages ignored because they could not prove their node."""
        return self.server.faults.count("unregistered") + self.server.faults.count("spoofed")

    def send(self, node_id: str, msg, then_forget: bool = False, resolved: bool = True) -> concurrent.futures.Future:
        """Queue `msg` for the node; the future fails when it could not be delivered (node gone).
        `then_forget`: the node leaves the registry once the message left (or could not); `resolved`: as `forget`'s."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.outbox.put((node_id, msg, done, then_forget, resolved))
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

    def silent_s(self, node_id: str) -> float:
        """Seconds since the node was last heard (registration or heartbeat); inf when not registered."""
        info = self.nodes.get(node_id)
        return time.time() - info.last_seen if info is not None else float("inf")

    def can_relay(self, node_id: str) -> bool:
        info = self.nodes.get(node_id)
        return info is not None and info.relays

    def link(self, node_id: str) -> Link | None:
        """The node's link, if it is in the run (one look, where `links` copies them all)."""
        info = self.nodes.get(node_id)
        return info.link if info is not None else None

    def on_relayed(self, handle: Callable[[Relayed], None]) -> None:
        """Who takes a node's `Relayed` (called in this thread: it must only queue)."""
        self._relayed = handle

    def location(self, node_id: str) -> Location | None:
        """Where the node said it runs (None once it left)."""
        info = self.nodes.get(node_id)
        return info.where if info is not None else None

    # ---- membership: the one place nodes leave the run ------------------------------------------

    def attach(self, node_id: str, link: Link) -> None:
        """Keep `link` with the node until it leaves the run (then it is closed); closed at once when the
        node is no longer in the run, and a link it had before is closed."""
        if not self._swap(node_id, link):
            link.close()

    def links(self) -> dict[str, Link]:
        """The links of the nodes in the run now (a copy: the caller may iterate while nodes leave)."""
        with self.lock:
            return {node_id: info.link for node_id, info in self.nodes.items() if info.link is not None}

    def _detach(self, node_id: str) -> None:
        self._swap(node_id, None)

    def _swap(self, node_id: str, link: Link | None) -> bool:
        """Put `link` on the node's entry and close the one it had; False when the node is not in the run."""
        with self.lock:
            info = self.nodes.get(node_id)
            before = info.link if info is not None else None
            if info is not None:
                info.link = link
        if before is not None:
            before.close()
        return info is not None

    @property
    def count(self) -> int:
        """Nodes in the run now."""
        return len(self.nodes)

    def leave(self, node_id: str) -> None:
        """The node said goodbye (a `left` event): it is out of the run."""
        self.forget(node_id)
        self._record("node_left", node_id)

    def evict(self, node_id: str, why: str) -> None:
        """The node cannot take the run's weights (the publisher reported why): told `Stop`, then out."""
        log.error("evicted node %s: %s", node_id, why)
        self._detach(node_id)  # its link ends now, not when the Stop is out
        self.evicted += 1
        self.send(node_id, Stop(reason=f"evicted: {why}"), then_forget=True, resolved=False)
        self._record("node_evicted", node_id, why=why)

    def lost(self, node_id: str, why: str) -> None:
        """The ledger reaped the node (no heartbeat): a frozen node that wakes up is told to stop, so it
        leaves instead of generating for a run that sends it no weights; a dead one is just out."""
        if node_id in self.nodes:
            self._detach(node_id)
            self.send(node_id, Stop(reason=why), then_forget=True)
        else:
            self.forget(node_id)
        self._record("node_lost", node_id, why=why)

    def stop_all(self, reason: str) -> None:
        """Tell every node to stop; each leaves with its Goodbye (`take_events`)."""
        for node_id in list(self.nodes):
            self.send(node_id, Stop(reason=reason))

    def _record(self, event: str, node_id: str, **fields) -> None:
        if self.run_events is not None:
            self.run_events.emit(event, node=node_id, **fields)

    def forget(self, node_id: str, resolved: bool = True) -> None:
        """Out of the run: no longer probed. `resolved`: what it held is resolved in the ledger (it said goodbye, or
        the ledger reaped it), so it is no longer unreachable either (the learner stops asking the ledger who holds
        each group it waits for); an evicted node's groups are not (a killed node is evicted when a push to it
        fails, before the reaper): it stays unreachable, so they are given up at once, until the reaper's `lost`."""
        self._detach(node_id)
        with self.lock:
            info = self.nodes.pop(node_id, None)
            if info is not None:
                self.departed[node_id] = (info.peer, info.key)
        self.reachability.left_run(node_id, resolved)

    def close(self) -> None:
        """Stop the control thread and close the socket and every node's link."""
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=5.0)
        for node_id in list(self.nodes):
            self._detach(node_id)
        self.server.close()
