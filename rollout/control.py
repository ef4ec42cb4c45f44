"""A rollout node's two service threads: the control channel (`ControlLoop`) and its life in the
ledger (`LedgerHeartbeat`), which also watches whether another learner took the run over.

ZMQ sockets are not thread-safe: the control socket is `ControlLoop`'s while it runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time

from streamrl.engine.control import HEARTBEAT_S, ControlClient
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import Heartbeat, Relayed, RelayTo, Stop, WeightsApplied, WeightsReady
from streamrl.engine.transport import TransportError
from streamrl.engine.weights.relay import Relay

log = logging.getLogger("streamrl.rollout")

# HEARTBEAT_S (engine/control.py): a node silent past a beat is asked whether its connection is open
# (learner/reachability.py); the learner gives up the groups of a node whose connection closed, or silent for 2 s
# (learner/overdue.py)


class ControlLoop(threading.Thread):
    """Heartbeats to the learner out; WeightsReady and Stop in. The control socket is this thread's.

    A `WeightsReady` starts the update on the node's event loop and the thread goes on serving (the
    engine keeps generating while the version is staged); the `WeightsApplied` is sent from here once
    the version is live. `first_weights` is set once a version went live (a node joining past version
    0 waits for it before generating). When `watch` saw another learner take the run over, the node
    abandons its groups and `moved_to` holds the new learner's control address. A `RelayTo` names the nodes
    this one forwards each version to (`relay`, on an engine whose receiver runs in this process); their
    layouts go back to the learner from here (`Relayed`); a vLLM engine's relay runs in its worker
    (rollout/backends/vllm_relay.py)."""

    def __init__(self, client: ControlClient, node, loop: asyncio.AbstractEventLoop, watch: LedgerHeartbeat, sink):
        super().__init__(name="control", daemon=True)
        self.client, self.node, self.loop, self.watch, self.sink = client, node, loop, watch, sink
        self.stopping = threading.Event()
        self.first_weights = threading.Event()
        self.stop_reason = ""
        self.moved_to = ""
        self._applied: queue.Queue[WeightsApplied] = queue.Queue()
        self._beats_failing = False
        self._relayed: queue.Queue[Relayed] = queue.Queue()
        self.relay = relay_for(node, self._relayed, loop)

    def run(self) -> None:
        try:
            self._serve()
        finally:
            if self.relay is not None:
                self.relay.close()

    def _serve(self) -> None:
        last_beat = 0.0
        while not self.stopping.is_set():
            if self.watch.moved:
                self._follow(self.watch.moved)
                return
            if time.monotonic() - last_beat > HEARTBEAT_S:
                self._beat()
                last_beat = time.monotonic()
            self._confirm()
            msg = self.client.recv(0.02)
            if isinstance(msg, WeightsReady):
                self._apply(msg)
            elif isinstance(msg, RelayTo) and self.relay is not None:
                self.relay.assign(msg.children, msg.versions)
            elif isinstance(msg, Stop):
                self.stop_reason = msg.reason
                log.info("the learner asked this node to stop: %s", msg.reason)
                self.loop.call_soon_threadsafe(self.node.abandon, msg.reason)  # no learner to send to
                self.first_weights.set()  # nothing more will come; let a waiting start-up end
                return

    def _follow(self, learner: dict[str, str]) -> None:
        """Another learner serves the run now: what this node generated for the old one goes nowhere."""
        self.stop_reason = f"the learner restarted (incarnation {learner.get('incarnation')})"
        self.moved_to = learner.get("control_addr", "")
        log.warning("%s at %s: abandoning this node's groups to register there", self.stop_reason, self.moved_to)
        self.sink.cancel()  # a send blocked on the old learner ends within a slice
        self.loop.call_soon_threadsafe(self.node.abandon, self.stop_reason)
        self.first_weights.set()

    def _beat(self) -> None:
        clock = getattr(self.node.engine, "clock", None)
        generate_s, idle_s, swap_s = clock.snapshot() if clock is not None else (0.0, 0.0, 0.0)
        try:
            self.client.send(
                Heartbeat(
                    node_id=self.node.node_id,
                    policy_version=self.node.policy_version,
                    in_flight=len(self.node.in_flight),
                    tokens_generated=self.node.stats.tokens_sent,
                    generate_s=generate_s,
                    idle_s=idle_s,
                    swap_s=swap_s,
                    peak_gib=_peak_gib(),
                ),
                timeout_s=1.0,
            )
        except TransportError as e:
            if not self._beats_failing:  # once, not every second while the learner is away
                log.warning("heartbeat to the learner failed: %s", e)
            self._beats_failing = True
            return
        if self._beats_failing:
            log.info("heartbeats reach the learner again")
        self._beats_failing = False

    def _apply(self, ready: WeightsReady) -> None:
        if self.relay is not None:
            self.relay.expect(ready)  # its children are due this version's layouts
        future = asyncio.run_coroutine_threadsafe(self.node.apply_weights(ready), self.loop)
        future.add_done_callback(lambda done: self._applied.put(self._outcome(ready, done)))

    def _outcome(self, ready: WeightsReady, done) -> WeightsApplied:
        error, seconds = "", 0.0
        if done.cancelled():  # the node is stopping: not a failure of the weights
            log.info("weights version %d not applied: the node is stopping", ready.version)
            return WeightsApplied(
                node_id=self.node.node_id, version=ready.version, seconds=0.0, error="the node is stopping"
            )
        try:
            seconds = done.result()
        except Exception as e:  # noqa: BLE001 - reported to the learner, which evicts the node
            error = f"{type(e).__name__}: {e}"
            if self.stop_reason or getattr(self.node, "stopping", False):  # the engine closed under the stop
                log.info("weights version %d not applied: the node is stopping (%s)", ready.version, error)
            else:
                log.error("weights version %d failed: %s", ready.version, error)
        return WeightsApplied(node_id=self.node.node_id, version=ready.version, seconds=seconds, error=error)

    def _confirm(self) -> None:
        self._send_relayed()
        while True:
            try:
                applied = self._applied.get_nowait()
            except queue.Empty:
                return
            try:
                self.client.send(applied, timeout_s=1.0)  # a learner that is gone must not hold this thread
            except TransportError as e:  # the learner times the version out and evicts; keep serving
                log.warning("could not confirm weights version %d: %s", applied.version, e)
            if not applied.error:
                self.first_weights.set()

    def _send_relayed(self) -> None:
        """The children's layouts this node's relay made, to the learner (which hands each to its child)."""
        while True:
            try:
                relayed = self._relayed.get_nowait()
            except queue.Empty:
                return
            try:
                self.client.send(relayed, timeout_s=1.0)
            except TransportError as e:  # the child is not sent this version; the learner moves it on
                log.warning("could not relay version %d to %s: %s", relayed.ready.version, relayed.child, e)


def can_relay(engine) -> bool:
    """Whether a node on `engine` can forward the versions it receives (`relay_for` makes it a relay)."""
    return hasattr(engine, "relay") or getattr(engine, "stager", None) is not None


def relay_for(node, out: queue.Queue[Relayed], loop: asyncio.AbstractEventLoop):
    """The node's relay: where its receiver runs in this process (`stager`: the sim and hf engines) one on it; a
    vLLM engine's runs in its worker, and so does its relay (`engine.relay`: rollout/backends/vllm_relay.py).
    Its layouts for children go to `out`; None for an engine that cannot relay."""
    node_id = node.node_id

    def announce(child: str, ready: WeightsReady) -> None:
        out.put(Relayed(node_id=node_id, child=child, ready=ready))

    if hasattr(node.engine, "relay"):
        return node.engine.relay(node_id, announce, loop)
    stager = getattr(node.engine, "stager", None)
    if stager is None:
        return None
    stager.relay = Relay(node_id, announce)
    return stager.relay


def _peak_gib() -> float:
    """This process's peak CUDA memory allocated through torch (an hf node's; vLLM's workers are their own)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0.0
    return torch.cuda.max_memory_allocated() / 2**30


class LedgerHeartbeat(threading.Thread):
    """Keeps the node alive in the ledger, apart from the control thread (which may be busy applying
    weights for longer than a heartbeat period), and watches the run's learner there: `moved` is the
    announcement (`Ledger.learner()`) of a learner other than `incarnation`, the one this node serves."""

    def __init__(self, ledger: Ledger, node_id: str, incarnation: str):
        super().__init__(name="ledger-heartbeat", daemon=True)
        self.ledger, self.node_id, self.incarnation = ledger, node_id, incarnation
        self.period_s = ledger.config.heartbeat_ttl_s / 4
        self.stopping = threading.Event()
        self.moved: dict[str, str] = {}

    def run(self) -> None:
        while not self.stopping.wait(self.period_s):
            try:
                self.ledger.heartbeat(self.node_id)
                learner = self.ledger.learner()
            except Exception as e:  # noqa: BLE001 - a missed beat is logged; the ledger's TTL judges
                log.warning("ledger heartbeat failed: %s", e)
                continue
            if learner.get("incarnation", self.incarnation) != self.incarnation:
                self.moved = learner
