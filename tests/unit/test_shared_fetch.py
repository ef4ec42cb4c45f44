"""Nodes of the learner's machine that fetch each version from its one shared set (learner/shared_fetch.py),
over real shared memory and a real TCPStore: nodes are threads with real `Stager`s (test_publisher's
`FakeRegistry`), the publisher is the learner's.

What it promises: past `weights.fetch_after` nodes get no link of their own (no thread, no store each), and
every one of them still gets every version it is behind on, the newest, bit-exact; a member that never
copies, or never says a version is live, is evicted once after one deadline, and meanwhile the others get
the next versions (one member never holds the rest); a member that leaves mid-copy is dropped from its
round at once; a LoRA push carries its adapter to every member.
"""

from __future__ import annotations

import threading
import time

import torch

from streamrl.engine.config import build
from streamrl.engine.messages import AdapterSpec, WeightsReady
from streamrl.engine.weights import here
from streamrl.learner.publisher import Publisher, _Link
from streamrl.learner.shared_fetch import Member
from tests.unit.test_publisher import TIMEOUT_S, FakeRegistry, _poll_until, _until, _weights


class RecordingRegistry(FakeRegistry):
    """`FakeRegistry` that also keeps every `WeightsReady` it hands a node (what crossed the control channel)."""

    def __init__(self, behaviours: dict[str, str]):
        super().__init__(behaviours)
        self.readies: dict[str, list[WeightsReady]] = {n: [] for n in behaviours}

    def send(self, node_id, msg, then_forget=False, resolved=True):
        if isinstance(msg, WeightsReady):
            self.readies[node_id].append(msg)
        return super().send(node_id, msg, then_forget, resolved)


def _publisher(nodes: FakeRegistry, fetch_after: int, adapter: AdapterSpec | None = None) -> Publisher:
    sets = ["weights.bucket_mb=0.01", f"weights.timeout_s={TIMEOUT_S}", f"weights.fetch_after={fetch_after}"]
    publisher = Publisher(build({}, sets), nodes, torch.device("cpu"), adapter=adapter)
    for node_id in nodes.behaviours:  # every node on the learner's machine: shared memory
        publisher.add(node_id, here("cpu"))
    return publisher


def _applied(publisher: Publisher) -> dict[str, int]:
    return {n: s.applied for n, s in publisher.states().items()}


def _weight_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("weights-") and t.is_alive())


def test_nodes_past_fetch_after_share_one_thread_and_get_every_version_bit_exact():
    nodes = RecordingRegistry({f"n{i}": "ok" for i in range(12)})
    threads_before = _weight_threads()
    publisher = _publisher(nodes, fetch_after=2)
    try:
        links = nodes.links()
        assert sorted(n for n, link in links.items() if isinstance(link, _Link)) == ["n0", "n1"]
        assert all(isinstance(links[f"n{i}"], Member) for i in range(2, 12))
        assert _weight_threads() - threads_before == 3  # 2 links + 1 for the 10 members (the old code: 12)
        for version in (1, 2, 3):
            publisher.publish(version, _weights(version))
            _poll_until(publisher, lambda v=version: min(_applied(publisher).values()) >= v, 10)
        assert _applied(publisher) == {f"n{i}": 3 for i in range(12)}
        assert {s.path for s in publisher.states().values()} == {"shm"}
        ports = {r.store_port for i in range(2, 12) for r in nodes.readies[f"n{i}"]}
        prefixes = {r.group_prefix for i in range(2, 12) for r in nodes.readies[f"n{i}"]}
        assert len(ports) == 1 and len(prefixes) == 10  # one store; each member its own confirmation keys
        for i in range(12):
            versions = [v for v, _ in nodes.live[f"n{i}"]]
            assert versions == [1, 2, 3], (i, versions)
            _, got = nodes.live[f"n{i}"][-1]
            assert torch.equal(got["embed"], _weights(3)["embed"]) and torch.equal(got["norm"], _weights(3)["norm"])
    finally:
        nodes.close()


def test_a_member_that_never_copies_is_evicted_after_one_deadline_and_never_holds_the_others():
    nodes = FakeRegistry({"a": "ok", "b": "ok", "dead": "silent"})
    publisher = _publisher(nodes, fetch_after=0)
    try:
        start = time.monotonic()
        publisher.publish(1, _weights(1))
        _poll_until(publisher, lambda: _applied(publisher)["a"] == 1 and _applied(publisher)["b"] == 1, 5)
        publisher.publish(2, _weights(2))  # "dead" is still in version 1's round, which waits for it
        _poll_until(publisher, lambda: _applied(publisher)["a"] == 2 and _applied(publisher)["b"] == 2, 5)
        assert time.monotonic() - start < TIMEOUT_S * 0.8  # both versions out before the dead one's deadline
        evicted = _poll_until(publisher, lambda: "dead" not in publisher.states(), TIMEOUT_S + 10)
        waited = time.monotonic() - start
        assert evicted == ["dead"] and nodes.stopped == ["dead"]
        assert TIMEOUT_S * 0.8 < waited < TIMEOUT_S + 8  # one deadline
        publisher.publish(3, _weights(3))
        _poll_until(publisher, lambda: _applied(publisher) == {"a": 3, "b": 3}, 10)
        assert _applied(publisher) == {"a": 3, "b": 3}
        # the learner's claim on dead's version 1 stays (were it deleted, a late copy's claim would win);
        # the six confirmations of a and b are gone
        _until(lambda: _fetch_keys(publisher) == 1, 5)
        assert _fetch_keys(publisher) == 1
    finally:
        nodes.close()


def test_a_member_that_never_says_its_version_is_live_is_evicted_after_one_deadline():
    nodes = FakeRegistry({"ok": "ok", "stuck": "stuck"})
    publisher = _publisher(nodes, fetch_after=0)
    try:
        publisher.publish(1, _weights(1))
        evicted = _poll_until(publisher, lambda: "stuck" not in publisher.states(), TIMEOUT_S + 10)
        assert evicted == ["stuck"] and nodes.live["stuck"][0][0] == 1  # it copied; it never went live
        assert _applied(publisher) == {"ok": 1}
    finally:
        nodes.close()


def test_a_member_that_leaves_mid_copy_is_dropped_from_its_round_at_once():
    # "dead" never copies; it leaves the run (as a killed node's closed connection makes it leave) while
    # version 1's round waits for it: the round ends then, not at the deadline, and its set is free again
    nodes = FakeRegistry({"a": "ok", "dead": "silent"})
    publisher = _publisher(nodes, fetch_after=0)
    try:
        publisher.publish(1, _weights(1))
        _poll_until(publisher, lambda: _applied(publisher)["a"] == 1, 5)
        time.sleep(0.2)
        assert publisher._sets.latest.readers == 1  # the positive control: version 1's round still holds its set
        start = time.monotonic()
        nodes.leave("dead")
        while publisher._sets.latest.readers and time.monotonic() - start < TIMEOUT_S:
            time.sleep(0.01)
        assert publisher._sets.latest.readers == 0 and time.monotonic() - start < TIMEOUT_S / 2
        assert publisher.poll() == []  # it left: nothing to evict
    finally:
        nodes.close()


def test_a_lora_push_carries_its_adapter_to_every_member():
    adapter = AdapterSpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    nodes = RecordingRegistry({f"n{i}": "ok" for i in range(4)})
    publisher = _publisher(nodes, fetch_after=1, adapter=adapter)
    try:
        publisher.publish(1, _weights(1))
        _poll_until(publisher, lambda: min(_applied(publisher).values()) >= 1, 10)
        assert _applied(publisher) == dict.fromkeys(nodes.behaviours, 1)
        assert all(r.adapter == adapter for readies in nodes.readies.values() for r in readies)
    finally:
        nodes.close()


def _fetch_keys(publisher: Publisher) -> int:
    return publisher._fetches["shm"].sender.store.num_keys()


def test_the_fetchs_store_holds_no_key_per_version():
    # the old code kept every member's confirmation: after 8 versions to 4 members, 32 keys (4 after each)
    nodes = FakeRegistry({f"n{i}": "ok" for i in range(4)})
    publisher = _publisher(nodes, fetch_after=0)
    try:
        keys = []
        for version in range(1, 9):
            publisher.publish(version, _weights(version))
            _poll_until(publisher, lambda v=version: min(_applied(publisher).values()) >= v, 10)
            _until(lambda: _fetch_keys(publisher) == 0, 5)  # deleted by the round once it read them
            keys.append(_fetch_keys(publisher))
        assert keys == [0] * 8 and _applied(publisher) == dict.fromkeys(nodes.behaviours, 8)
        assert all([v for v, _ in nodes.live[n]] == list(range(1, 9)) for n in nodes.behaviours)  # none lost
        assert torch.equal(nodes.live["n3"][-1][1]["embed"], _weights(8)["embed"])
    finally:
        nodes.close()
