"""The learner's weight publisher over real gloo groups and real shared memory: nodes as threads with
real `Stager`s.

What it promises: `publish` holds the learner for the packing alone, whatever the nodes do; every
node gets the newest version, in order, bit-exact; a node that never receives, or never confirms a
version live, is evicted once, after one deadline, while the others keep receiving. The same on both
paths (`shared`: the nodes named there say they run on the learner's machine, so they copy from shared
memory; the others get a gloo broadcast).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

import pytest
import torch

from streamrl.engine.config import build
from streamrl.engine.messages import Stop, WeightsApplied, WeightsReady
from streamrl.engine.weights import Stager, here
from streamrl.learner.nodes import NodeInfo, NodeRegistry
from streamrl.learner.publisher import Publisher

TIMEOUT_S = 2.0


class FakeBusyEngine:
    """Stands in for a node's engine in the middle of its batch: the node receives a version only after
    `step()`, which holds it for `seconds` (a real engine is free between its steps)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def step(self) -> None:
        time.sleep(self.seconds)


class FakeRegistry(NodeRegistry):
    """Stands in for `NodeRegistry`'s control channel only: `send` hands a `WeightsReady` to the node, a
    thread on a real gloo group or shared memory, and `take_applied` reads what the node confirmed; the
    membership (`attach`, `links`, `evict`, `forget`) is NodeRegistry's own code, so the links it closes
    are the ones the real registry would.

    Behaviours: "ok" receives, swaps, confirms; "silent" never joins its group; "stuck" receives but
    never confirms the version live; "slow" receives after its `FakeBusyEngine` step of `slow_s`."""

    def __init__(self, behaviours: dict[str, str], slow_s: float = 0.0):
        super().__init__(server=None, welcome=None)  # no socket: the control thread is never started
        self.behaviours = behaviours
        self.confirmed: dict[str, queue.Queue] = {n: queue.Queue() for n in behaviours}
        self.live: dict[str, list[tuple[int, dict]]] = {n: [] for n in behaviours}
        self.stopped: list[str] = []
        self.forgotten: list[str] = []
        self.stagers = {n: Stager("cpu") for n in behaviours}
        self.engine = FakeBusyEngine(slow_s)
        for node_id in behaviours:  # registered, as a Register would
            self.nodes[node_id] = NodeInfo(peer=node_id.encode(), host="here", registered=0.0, last_seen=0.0)

    def send(self, node_id, msg, then_forget=False, resolved=True):
        done = concurrent.futures.Future()
        if isinstance(msg, WeightsReady) and self.behaviours[node_id] != "silent":
            threading.Thread(target=self._node, args=(node_id, msg), daemon=True).start()
        elif isinstance(msg, Stop):
            self.stopped.append(node_id)
        if then_forget:
            self.forgotten.append(node_id)
            self.forget(node_id, resolved)
        done.set_result(None)
        return done

    def _node(self, node_id: str, ready: WeightsReady) -> None:
        if self.behaviours[node_id] == "slow":
            self.engine.step()
        staged = self.stagers[node_id].receive(ready)
        self.live[node_id].append((staged.version, {k: v.clone() for k, v in staged.named}))
        self.stagers[node_id].release()
        if self.behaviours[node_id] != "stuck":
            self.confirmed[node_id].put(WeightsApplied(node_id=node_id, version=ready.version, seconds=0.01))

    def take_applied(self, node_id):
        try:
            return self.confirmed[node_id].get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        for node_id in list(self.nodes):
            self.forget(node_id)


def _publisher(nodes: FakeRegistry, shared: tuple[str, ...] = ()) -> Publisher:
    cfg = build({}, ["weights.bucket_mb=0.01", f"weights.timeout_s={TIMEOUT_S}"])
    publisher = Publisher(cfg, nodes, torch.device("cpu"))
    for node_id in nodes.behaviours:  # a node of unknown location gets a collective (gloo on CPU)
        publisher.add(node_id, here("cpu") if node_id in shared else None)
    assert {n: s.path for n, s in publisher.states().items()} == {
        n: "shm" if n in shared else "gloo" for n in nodes.behaviours
    }
    return publisher


def _weights(version: int) -> dict[str, torch.Tensor]:
    embed = torch.arange(4000, dtype=torch.float32).reshape(200, 20) * version
    return {"embed": embed, "norm": torch.full((20,), float(version)), "head": embed}  # tied


def _evict_reported(publisher: Publisher) -> list[str]:
    # as the orchestrator: the publisher reports, the registry evicts
    return [publisher.registry.evict(node_id, why) or node_id for node_id, why in publisher.poll()]


def _poll_until(publisher: Publisher, cond, timeout_s: float) -> list[str]:
    evicted, deadline = [], time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        evicted += _evict_reported(publisher)
        time.sleep(0.02)
    return evicted + _evict_reported(publisher)


def _until(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.mark.parametrize("shared", [(), ("a", "dead")], ids=["gloo", "shm-and-gloo"])
def test_publish_holds_only_for_packing_and_a_silent_node_is_evicted_after_one_deadline(shared):
    nodes = FakeRegistry({"a": "ok", "b": "ok", "dead": "silent"})
    publisher = _publisher(nodes, shared)
    try:
        held = publisher.publish(1, _weights(1))
        assert held < 0.5  # packing 32 KB; the dead node's deadline is not the learner's
        start = time.monotonic()
        evicted = _poll_until(publisher, lambda: "dead" not in publisher.states(), TIMEOUT_S + 10)
        waited = time.monotonic() - start
        assert evicted == ["dead"] and nodes.stopped == ["dead"] and nodes.forgotten == ["dead"]
        assert TIMEOUT_S * 0.8 < waited < TIMEOUT_S + 8  # one deadline, not one per phase or bucket
        assert publisher.publish(2, _weights(2)) < 0.5  # the survivors carry on
        _poll_until(publisher, lambda: all(s.applied == 2 for s in publisher.states().values()), 10)
        assert {n: s.applied for n, s in publisher.states().items()} == {"a": 2, "b": 2}
        assert nodes.evicted == 1
        for node in ("a", "b"):
            version, got = nodes.live[node][-1]
            assert version == 2 and got.keys() == {"embed", "norm", "head"}
            assert torch.equal(got["embed"], _weights(2)["embed"]) and torch.equal(got["head"], got["embed"])
    finally:
        nodes.close()


@pytest.mark.parametrize("shared", [(), ("busy",)], ids=["gloo", "shm"])
def test_a_busy_node_gets_the_newest_version_in_order_and_never_delays_publish(shared):
    nodes = FakeRegistry({"busy": "slow"}, slow_s=0.5)
    publisher = _publisher(nodes, shared)
    try:
        holds = []
        for version in range(1, 6):  # five versions while the node takes 0.5 s per receive
            holds.append(publisher.publish(version, _weights(version)))
            time.sleep(0.1)
        assert max(holds) < 0.5
        _poll_until(publisher, lambda: publisher.states()["busy"].applied == 5, 15)
        versions = [v for v, _ in nodes.live["busy"]]
        assert versions[-1] == 5 and versions == sorted(versions) and len(versions) < 5  # skipped to the newest
        assert torch.equal(nodes.live["busy"][-1][1]["norm"], torch.full((20,), 5.0))
    finally:
        nodes.close()


def test_a_node_that_never_confirms_a_version_live_is_evicted_after_one_deadline():
    nodes = FakeRegistry({"ok": "ok", "stuck": "stuck"})
    publisher = _publisher(nodes, shared=("stuck",))
    try:
        publisher.publish(1, _weights(1))
        evicted = _poll_until(publisher, lambda: "stuck" not in publisher.states(), TIMEOUT_S + 10)
        assert evicted == ["stuck"] and nodes.live["stuck"][0][0] == 1  # it did receive; it never went live
        assert publisher.states()["ok"].applied == 1
    finally:
        nodes.close()


def _link_keys(publisher: Publisher) -> dict[str, int]:
    return {node_id: link.sender.store.num_keys() for node_id, link in publisher._links().items()}


def test_a_links_store_holds_no_key_per_version():
    # the old code kept each version's key: after 8 versions the shm link's store held 8 (copied/<v>/1), the
    # gloo link's 12 (its group's 4 and posted/<v>)
    nodes = FakeRegistry({"g": "ok", "s": "ok"})
    publisher = _publisher(nodes, shared=("s",))
    try:
        keys = []
        for version in range(1, 9):
            publisher.publish(version, _weights(version))
            _poll_until(publisher, lambda v=version: all(s.applied >= v for s in publisher.states().values()), 10)
            _until(lambda: _link_keys(publisher)["s"] == 0, 5)  # the link deletes the node's word once it read it
            keys.append(_link_keys(publisher))
        assert keys == [{"g": keys[0]["g"], "s": 0}] * 8, keys  # the gloo group's own keys stay
        assert [v for v, _ in nodes.live["g"]] == [v for v, _ in nodes.live["s"]] == list(range(1, 9))  # none lost
    finally:
        nodes.close()


class FakeLink:
    """Stands in for the publisher's `_Link` (a node's weights thread): records that it was closed."""

    def __init__(self):
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_registry_closes_a_nodes_link_however_the_node_leaves():
    nodes = FakeRegistry(dict.fromkeys(["left", "evicted", "lost", "again", "kept"], "ok"))
    links = {node_id: FakeLink() for node_id in nodes.behaviours}
    for node_id, link in links.items():
        nodes.attach(node_id, link)
    nodes.leave("left")
    nodes.evict("evicted", "its transfer failed")
    nodes.lost("lost", "no heartbeat")
    nodes.lost("lost", "reaped again after it was gone")  # a node no longer in the run: nothing to close
    nodes.attach("again", FakeLink())  # a node's new process: the old link ends
    assert {node_id for node_id, link in links.items() if link.closed} == {"left", "evicted", "lost", "again"}
    assert set(nodes.links()) == {"again", "kept"}  # the positive control: the others' links are kept
    late = FakeLink()
    nodes.attach("left", late)  # a link for a node that left meanwhile is closed at once
    assert late.closed and "left" not in nodes.links()
