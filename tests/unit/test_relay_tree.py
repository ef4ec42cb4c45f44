"""Nodes of other hosts that get each version relayed by other nodes (learner/relay_tree.py, engine/weights/relay.py),
over real gloo groups on loopback: nodes are threads with real `Stager`s and real `Relay`s (test_publisher's
`FakeRegistry`, every node of unknown location, so a broadcast), the publisher is the learner's.

What it promises: with `weights.relay_fanout = k` the learner links to k nodes only (k threads, whatever the
number of nodes) and every node still gets every version, bit-exact; a parent that leaves the run mid-run, or
dies silently (evicted at its deadline), costs its children nothing but a new parent; a child that never says
a version is live is evicted once after one deadline; a LoRA push carries its adapter down the tree;
`relay_fanout = 0` is a link a node, as before.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streamrl.engine.config import build
from streamrl.engine.messages import AdapterSpec, Relayed, RelayTo, WeightsApplied, WeightsReady
from streamrl.engine.weights.paths import WeightTransferError
from streamrl.engine.weights.relay import Relay
from streamrl.learner.publisher import Publisher, _Link
from streamrl.learner.relay_tree import LEARNER, Child
from tests.unit.test_publisher import FakeRegistry, _poll_until, _weights

# above test_publisher's 2 s: each child's group opens a TCPStore at its parent, and on this machine about one
# TCPStore connection in 27 takes 5 s (measured: 120 opens in a row, no other load, torch 2.13)
TIMEOUT_S = 8.0


class RelayingRegistry(FakeRegistry):
    """`FakeRegistry` whose nodes can relay: a `RelayTo` goes to the node's `Relay` (on its stager), and a
    `Relayed` the relay makes goes to the publisher's tree as the registry's control thread hands it on."""

    def __init__(self, behaviours: dict[str, str]):
        super().__init__(behaviours)
        self.readies: dict[str, list[WeightsReady]] = {n: [] for n in behaviours}
        self.relays: dict[str, Relay] = {}
        for node_id, info in self.nodes.items():
            info.relays = True
            self.relays[node_id] = self.stagers[node_id].relay = Relay(node_id, self._announcer(node_id))

    def _announcer(self, node_id: str):
        return lambda child, ready: self._relayed(Relayed(node_id=node_id, child=child, ready=ready))

    def send(self, node_id, msg, then_forget=False, resolved=True):
        if isinstance(msg, RelayTo) and self.behaviours[node_id] != "silent":
            self.relays[node_id].assign(msg.children, msg.versions)
        if isinstance(msg, WeightsReady):
            self.readies[node_id].append(msg)
        return super().send(node_id, msg, then_forget, resolved)

    def _node(self, node_id: str, ready: WeightsReady) -> None:
        try:
            super()._node(node_id, ready)
        except WeightTransferError as e:  # reported, as a node's control loop reports it
            self.confirmed[node_id].put(WeightsApplied(node_id=node_id, version=ready.version, seconds=0, error=str(e)))

    def die(self, node_id: str) -> None:
        """The node's process is gone: it receives nothing and relays nothing (its entry stays until evicted)."""
        self.behaviours[node_id] = "silent"
        self.relays[node_id].close()

    def close(self) -> None:
        super().close()
        for relay in self.relays.values():
            relay.close()


def _publisher(nodes: FakeRegistry, fanout: int, adapter: AdapterSpec | None = None) -> Publisher:
    sets = ["weights.bucket_mb=0.01", f"weights.timeout_s={TIMEOUT_S}", f"weights.relay_fanout={fanout}"]
    publisher = Publisher(build({}, sets), nodes, torch.device("cpu"), adapter=adapter)
    for node_id in nodes.behaviours:  # no location: a broadcast (gloo), as for a node of another host
        publisher.add(node_id, None)
    return publisher


@pytest.fixture
def tree():
    """`tree(behaviours, fanout, adapter=None)`: a `RelayingRegistry` of those nodes and the learner's publisher
    over it, every node added; the registry (its nodes' relays with it) is closed when the test ends."""
    made: list[RelayingRegistry] = []

    def make(behaviours: dict[str, str], fanout: int, adapter: AdapterSpec | None = None):
        made.append(RelayingRegistry(behaviours))
        return made[-1], _publisher(made[-1], fanout, adapter)

    yield make
    for nodes in made:
        nodes.close()


def _applied(publisher: Publisher) -> dict[str, int]:
    return {n: s.applied for n, s in publisher.states().items()}


def _links(publisher: Publisher) -> list[str]:
    return sorted(n for n, link in publisher._links().items() if isinstance(link, _Link))


def _depth(publisher: Publisher, node_id: str) -> int:
    parent = publisher._links()[node_id].parent
    return 0 if parent == LEARNER else 1 + _depth(publisher, parent)


def _children(publisher: Publisher) -> dict[str, list[str]]:
    """Each node's children, read off the links as the tree reads them."""
    links = publisher._links()
    return {n: [c for c, link in links.items() if link.parent == n] for n in links}


def _all_at(publisher: Publisher, version: int, timeout_s: float = 30) -> list[str]:
    """Poll (evicting as the orchestrator does) until every node has `version` live; the nodes evicted meanwhile."""
    evicted = _poll_until(publisher, lambda: min(_applied(publisher).values()) >= version, timeout_s)
    assert min(_applied(publisher).values()) >= version, _applied(publisher)
    return evicted


def test_fourteen_nodes_at_fanout_two_get_every_version_bit_exact_from_two_learner_links(tree):
    nodes, publisher = tree({f"n{i:02d}": "ok" for i in range(14)}, fanout=2)
    assert _links(publisher) == ["n00", "n01"]  # the learner's links: the fan-out, not the nodes
    assert all(isinstance(publisher._links()[f"n{i:02d}"], Child) for i in range(2, 14))
    assert max(len(c) for c in _children(publisher).values()) == 2
    assert max(_depth(publisher, n) for n in nodes.behaviours) == 2  # 2 + 4 + 8 nodes: log2(14) levels
    learner_threads = sum(1 for t in threading.enumerate() if t.name.startswith("weights-") and t.is_alive())
    assert learner_threads == 2
    for version in (1, 2, 3):
        publisher.publish(version, _weights(version))
        assert _all_at(publisher, version) == []
    assert _applied(publisher) == dict.fromkeys(nodes.behaviours, 3)
    for node_id in nodes.behaviours:
        versions = [v for v, _ in nodes.live[node_id]]
        assert versions == sorted(versions) and versions[-1] == 3, (node_id, versions)
        _, got = nodes.live[node_id][-1]
        assert torch.equal(got["embed"], _weights(3)["embed"]) and torch.equal(got["head"], got["embed"])
    relayed_from = {r.store_port for n in nodes.behaviours if _depth(publisher, n) for r in nodes.readies[n]}
    learner_ports = {link.sender.port for link in publisher._links().values() if isinstance(link, _Link)}
    assert relayed_from and not relayed_from & learner_ports  # the children's stores are their parents'


def test_fanout_zero_is_a_link_a_node(tree):
    nodes, publisher = tree({f"n{i}": "ok" for i in range(5)}, fanout=0)
    assert _links(publisher) == sorted(nodes.behaviours)
    publisher.publish(1, _weights(1))
    assert _all_at(publisher, 1) == []


def _a_parent(publisher: Publisher) -> tuple[str, list[str]]:
    """A node at depth 1 with children (it has a parent and children of its own), and its children."""
    children = _children(publisher)
    parent = next(n for n, kids in children.items() if kids and _depth(publisher, n) == 1)
    return parent, children[parent]


def test_a_parent_that_leaves_mid_run_hands_its_children_to_another_and_they_get_the_next_versions(tree):
    nodes, publisher = tree({f"n{i:02d}": "ok" for i in range(12)}, fanout=2)
    publisher.publish(1, _weights(1))
    assert _all_at(publisher, 1) == []
    parent, orphans = _a_parent(publisher)
    nodes.die(parent)
    nodes.leave(parent)  # its connection closed: the registry lets it go at once
    assert all(publisher._links()[o].parent not in (None, parent) for o in orphans)
    start = time.monotonic()
    for version in (2, 3):
        publisher.publish(version, _weights(version))
        assert _all_at(publisher, version) == []
    assert time.monotonic() - start < TIMEOUT_S  # no deadline waited for
    assert parent not in publisher.states() and _applied(publisher) == {n: 3 for n in nodes.behaviours if n != parent}
    assert torch.equal(nodes.live[orphans[0]][-1][1]["embed"], _weights(3)["embed"])


def test_a_parent_that_dies_silently_is_evicted_after_one_deadline_and_its_children_carry_on(tree):
    nodes, publisher = tree({f"n{i:02d}": "ok" for i in range(8)}, fanout=2)
    publisher.publish(1, _weights(1))
    assert _all_at(publisher, 1) == []
    parent, orphans = _a_parent(publisher)
    nodes.die(parent)  # still in the run: it is sent version 2 and never takes it
    start = time.monotonic()
    publisher.publish(2, _weights(2))
    evicted = _poll_until(publisher, lambda: parent not in publisher.states(), 2 * TIMEOUT_S + 10)
    assert evicted == [parent] and 2 * TIMEOUT_S * 0.8 < time.monotonic() - start < 2 * TIMEOUT_S + 8
    assert _all_at(publisher, 2) == []  # the orphans too, from their new parents
    assert all(nodes.live[o][-1][0] == 2 for o in orphans), {o: [v for v, _ in nodes.live[o]] for o in orphans}
    publisher.publish(3, _weights(3))
    assert _all_at(publisher, 3) == [] and nodes.evicted == 1


def test_a_child_that_never_says_its_version_is_live_is_evicted_after_one_deadline(tree):
    behaviours = {f"n{i}": "ok" for i in range(4)} | {"stuck": "stuck"}
    nodes, publisher = tree(behaviours, fanout=2)
    assert isinstance(publisher._links()["stuck"], Child)
    start = time.monotonic()
    publisher.publish(1, _weights(1))
    evicted = _poll_until(publisher, lambda: "stuck" not in publisher.states(), 2 * TIMEOUT_S + 10)
    assert evicted == ["stuck"] and nodes.live["stuck"][0][0] == 1  # it received; it never went live
    assert 2 * TIMEOUT_S * 0.8 < time.monotonic() - start < 2 * TIMEOUT_S + 8  # its transfer's, then its own
    assert _applied(publisher) == {f"n{i}": 1 for i in range(4)}


@pytest.mark.parametrize("fanout", [1])
def test_a_lora_push_carries_its_adapter_down_the_tree(fanout, tree):
    adapter = AdapterSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    # a chain: n0 -> n1 -> n2 -> n3
    nodes, publisher = tree({f"n{i}": "ok" for i in range(4)}, fanout=fanout, adapter=adapter)
    assert max(_depth(publisher, n) for n in nodes.behaviours) == 3
    publisher.publish(1, _weights(1))
    assert _all_at(publisher, 1) == []
    assert all(r.adapter == adapter for readies in nodes.readies.values() for r in readies)
    assert torch.equal(nodes.live["n3"][-1][1]["norm"], _weights(1)["norm"])
