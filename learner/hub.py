"""Learner rank 0's side of the run: the sockets, the ledger, the nodes and their weights.

`Hub.collect` receives trajectories until a step's worth of whole groups is there (admitting each
through the ledger: stale, failed-reward and duplicate samples are resolved there, never trained);
`Hub.commit` marks the step's samples trained and publishes the new version; `Hub.broadcast`
pushes the weights to every registered node. The ZMQ control socket belongs to one thread
(`_ControlThread`): sockets are not thread-safe, and the weight broadcaster's per-node threads
only ever talk to it through queues.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import pathlib
import queue
import threading
import time
from collections.abc import Mapping

import msgspec
from torch import Tensor

from streamrl.engine.config import Config
from streamrl.engine.ledger import Ledger, is_stale
from streamrl.engine.messages import (
    Goodbye,
    Heartbeat,
    Register,
    Stop,
    Trajectory,
    WeightsApplied,
    WeightsReady,
    Welcome,
)
from streamrl.engine.transport import ControlServer, TrajectoryReceiver, TransportError, bind_address
from streamrl.engine.weights import WeightBroadcaster

log = logging.getLogger("streamrl.learner")

REAP_EVERY_S = 2.0
WAITING_WARN_S = 30.0
GROUP_PATIENCE_S = 30.0  # a group missing members this long is used with the members it has


@dataclasses.dataclass
class NodeInfo:
    peer: bytes
    host: str
    registered: float
    last_seen: float
    version: int = 0
    tokens_generated: int = 0


@dataclasses.dataclass
class _Group:
    first_seen: float
    size: int
    fresh: list[Trajectory] = dataclasses.field(default_factory=list)
    resolved: int = 0  # members dropped or rejected on arrival

    @property
    def complete(self) -> bool:
        return len(self.fresh) + self.resolved >= self.size


class _ControlThread(threading.Thread):
    """Owns the ROUTER socket: answers registrations, records heartbeats, routes WeightsApplied."""

    def __init__(self, server: ControlServer, welcome: Welcome):
        super().__init__(name="control", daemon=True)
        self.server, self.welcome = server, welcome
        self.nodes: dict[str, NodeInfo] = {}
        self.events: queue.Queue[tuple[str, str]] = queue.Queue()  # ("joined" | "left", node_id)
        self.applied: dict[str, queue.Queue[WeightsApplied]] = collections.defaultdict(queue.Queue)
        self.outbox: queue.Queue[tuple[str, object, concurrent.futures.Future]] = queue.Queue()
        self.stopping = threading.Event()
        self.lock = threading.Lock()

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
                node_id, msg, done = self.outbox.get_nowait()
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

    def _handle(self, peer: bytes, msg) -> None:
        now = time.time()
        if isinstance(msg, Register):
            with self.lock:
                self.nodes[msg.node_id] = NodeInfo(peer, msg.host, now, now)
            self.server.send(peer, msgspec.structs.replace(self.welcome, node_id=msg.node_id))
            self.events.put(("joined", msg.node_id))
        elif isinstance(msg, Heartbeat) and msg.node_id in self.nodes:
            info = self.nodes[msg.node_id]
            info.last_seen, info.version, info.tokens_generated = now, msg.policy_version, msg.tokens_generated
        elif isinstance(msg, WeightsApplied):
            self.applied[msg.node_id].put(msg)
        elif isinstance(msg, Goodbye):
            log.info("node %s left: %s", msg.node_id, msg.reason)
            self.events.put(("left", msg.node_id))

    def send(self, node_id: str, msg) -> concurrent.futures.Future:
        """Queue `msg` for the node; the future fails when it could not be delivered (node gone)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.outbox.put((node_id, msg, done))
        return done

    def forget(self, node_id: str) -> None:
        with self.lock:
            self.nodes.pop(node_id, None)


class Hub:
    """Rank 0's I/O: trajectories in, ledger bookkeeping, control messages, weights out."""

    def __init__(self, cfg: Config, ledger: Ledger, redis_url: str, device, version: int = 0):
        t = cfg.transport
        self.cfg, self.ledger, self.version = cfg, ledger, version
        self.receiver = TrajectoryReceiver(bind_address(t.host, t.trajectory_port), hwm=t.hwm)
        self.welcome = Welcome(
            node_id="",
            trajectory_addr=self.receiver.addr,
            redis_url=redis_url,
            run_name=cfg.run.name,
            policy_version=version,
        )
        self.control = _ControlThread(
            ControlServer(bind_address(t.host, t.control_port), t.send_timeout_s), self.welcome
        )
        self.broadcaster = WeightBroadcaster(cfg.weights, device=device)
        self.groups: dict[str, _Group] = {}
        self.latest_state: Mapping[str, Tensor] | None = None
        self.counters = collections.Counter()
        self._last_reap = 0.0
        self.control.start()

    @property
    def control_addr(self) -> str:
        return self.control.server.addr

    def write_address_file(self, run_dir: pathlib.Path) -> pathlib.Path:
        """`RUN/learner.json`: where nodes find this learner (`streamrl rollout --run NAME`)."""
        path = run_dir / "learner.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "control_addr": self.control_addr,
                    "trajectory_addr": self.receiver.addr,
                    "redis_url": self.welcome.redis_url,
                    "run": self.cfg.run.name,
                }
            )
        )
        tmp.rename(path)
        return path

    # ---- receive → admit -------------------------------------------------------------------

    def collect(self, n_groups: int) -> list[list[Trajectory]]:
        """Block until `n_groups` whole groups of fresh samples are ready; return them (oldest first)."""
        waiting_since = last_warn = time.monotonic()
        while True:
            self.service()
            batch = self._drain(0.05)
            if batch:
                self._admit(batch)
                waiting_since = last_warn = time.monotonic()
            ready = self._take_ready(n_groups)
            if ready is not None:
                return ready
            if time.monotonic() - last_warn > WAITING_WARN_S:
                log.warning(
                    "waited %.0f s for trajectories: %d nodes registered, %d groups partly here; "
                    "start a node with `streamrl rollout --run %s`",
                    time.monotonic() - waiting_since,
                    len(self.control.nodes),
                    len(self.groups),
                    self.cfg.run.name,
                )
                last_warn = time.monotonic()

    def _drain(self, timeout_s: float, limit: int = 4096) -> list[Trajectory]:
        out: list[Trajectory] = []
        first = self.receiver.recv(timeout_s)
        while first is not None and len(out) < limit:
            out.append(first)
            first = self.receiver.recv(0.0)
        return out

    def _admit(self, batch: list[Trajectory]) -> None:
        received = self.ledger.receive(batch, self.version)
        self.counters.update(
            received=len(received.fresh),
            stale=len(received.stale),
            reward_error=len(received.reward_errors),
            rejected=len(received.rejected),
        )
        fresh_ids = {t.sample_id for t in received.fresh}
        now = time.monotonic()
        for traj in batch:
            group = self.groups.setdefault(traj.group_id, _Group(now, traj.group_size))
            if traj.sample_id in fresh_ids:
                group.fresh.append(traj)
            else:
                group.resolved += 1

    def _take_ready(self, n_groups: int) -> list[list[Trajectory]] | None:
        now = time.monotonic()
        ready_ids = [
            g for g, group in self.groups.items() if group.complete or now - group.first_seen > GROUP_PATIENCE_S
        ]
        usable = []
        for group_id in ready_ids:
            members = self._fresh_members(self.groups[group_id])
            if members:
                usable.append(group_id)
            else:
                del self.groups[group_id]
        if len(usable) < n_groups:
            return None
        return [self.groups.pop(g).fresh for g in usable[:n_groups]]

    def _fresh_members(self, group: _Group) -> list[Trajectory]:
        """Drop members that went stale while they waited here (staleness is judged at consumption)."""
        stale = [t for t in group.fresh if is_stale(t.min_version, self.version, self.cfg.ledger.max_staleness)]
        if stale:
            self.ledger.drop([t.sample_id for t in stale], "stale")
            self.counters.update(stale=len(stale))
            group.fresh = [t for t in group.fresh if t not in stale]
        return group.fresh

    # ---- nodes ---------------------------------------------------------------------------

    def service(self) -> None:
        """Registrations, departures and lost nodes; a new node gets the current weights first."""
        while True:
            try:
                kind, node_id = self.control.events.get_nowait()
            except queue.Empty:
                break
            if kind == "joined":
                self._join(node_id)
            else:
                self._remove(node_id)
        if time.monotonic() - self._last_reap > REAP_EVERY_S:
            self._last_reap = time.monotonic()
            for node_id, samples in self.ledger.reap_lost_nodes().items():
                log.warning(
                    "node %s stopped beating: %d in-flight samples resolved (%s)",
                    node_id,
                    samples,
                    self.cfg.ledger.on_node_lost,
                )
                self._remove(node_id)

    def _join(self, node_id: str) -> None:
        if node_id in self.broadcaster.senders:
            self.broadcaster.remove_node(node_id)  # a node that re-registers gets a fresh weight group
        # A restarted node numbers its messages from 0 again, and an old process's late WeightsApplied
        # must not be taken for the new one's answer.
        self.receiver.next_seq.pop(node_id, None)
        self.control.applied.pop(node_id, None)
        self.broadcaster.add_node(node_id)
        log.info("node %s joined (%d nodes)", node_id, len(self.broadcaster.nodes))
        if self.version > 0 and self.latest_state is not None:
            self.broadcast(self.latest_state, self.version, nodes=[node_id])

    def _remove(self, node_id: str) -> None:
        self.broadcaster.remove_node(node_id)
        self.control.forget(node_id)

    # ---- commit → broadcast ----------------------------------------------------------------

    def commit(self, groups: list[list[Trajectory]], version: int, step: int) -> int:
        """Mark the step's samples trained and publish `version`; how many were trained now."""
        ids = [t.sample_id for group in groups for t in group]
        trained = sum(self.ledger.commit_step(ids, version, step))
        self.version = version
        self.welcome.policy_version = version
        return trained

    def broadcast(self, state: Mapping[str, Tensor], version: int, nodes: list[str] | None = None) -> dict:
        """Push `state` as `version` to the nodes (all by default); failed nodes are evicted and told."""
        self.latest_state = state
        if not self.broadcaster.nodes:
            return {}
        results = self.broadcaster.broadcast(state, version, self._send_layout, self._wait_applied, nodes=nodes)
        for node_id, result in results.items():
            if not result.ok:
                log.error("evicted node %s: %s", node_id, result.error)
                told = self.control.send(node_id, Stop(reason=f"evicted: {result.error}"))
                try:  # forget the node only once the Stop left (or could not), or it is never sent
                    told.result(timeout=self.cfg.transport.send_timeout_s + 5.0)
                except Exception:  # noqa: BLE001 - gone already: nothing more to tell it
                    pass
                self.control.forget(node_id)
        return results

    def _send_layout(self, node_id: str, ready: WeightsReady) -> None:
        """Deliver the layout or raise at once: a node that is gone fails its transfer now, not at the
        rendezvous deadline."""
        self.control.send(node_id, ready).result(timeout=self.cfg.transport.send_timeout_s + 5.0)

    def _wait_applied(self, node_id: str, timeout_s: float) -> WeightsApplied | None:
        try:
            return self.control.applied[node_id].get(timeout=timeout_s)
        except queue.Empty:
            return None

    def nodes_alive(self) -> int:
        return len(self.broadcaster.nodes)

    def close(self, reason: str = "run finished", drain_s: float = 5.0) -> None:
        """Tell every node to stop, and keep taking (and discarding) what they still send until they
        said goodbye or `drain_s` passed, so no node blocks on a send to a learner that is gone; what
        they never delivered is resolved by their leaving the ledger."""
        for node_id in list(self.control.nodes):
            self.control.send(node_id, Stop(reason=reason))
        deadline = time.monotonic() + drain_s
        while self.control.nodes and time.monotonic() < deadline:
            self._drain(0.05)
            self.service()
        buffered = [t.sample_id for group in self.groups.values() for t in group.fresh]
        if buffered:  # received, never trained: resolved, so the books close
            self.ledger.drop(buffered, "preempted")
            self.groups.clear()
        self.control.stopping.set()
        self.control.join(timeout=5.0)
        for node_id in self.broadcaster.nodes:
            self.broadcaster.remove_node(node_id)
        self.control.server.close()
        self.receiver.close()
