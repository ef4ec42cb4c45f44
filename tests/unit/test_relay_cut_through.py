"""A relay forwards each bucket as it lands (engine/weights/relay.py `ArrivingBuckets`), over real gloo groups on
loopback: a learner's `WeightSender` to a parent node's `Stager` with a `Relay`, and the parent's send to a child
that receives as from the learner. The learner holds its last bucket back until the child has every bucket before
it: with store-and-forward (the whole version first) the child would have none, and the learner would wait in vain.
When the parent's own receive fails mid-version, the child's receive fails too, and the failed copy is given to
no later child."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from streamrl.engine.weights import WeightSender, WeightTransferError, pack, plan_buckets, push
from streamrl.engine.weights.collective import receive_flat
from streamrl.engine.weights.relay import Relay
from streamrl.engine.weights.staging import Stager

TIMEOUT_S = 8.0
CPU = torch.device("cpu")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(3)}


class Tree:
    """learner -> parent (a Stager with a Relay) -> child (a plain receive that notes each bucket's arrival)."""

    def __init__(self) -> None:
        self.sender = WeightSender("parent", backend="gloo", timeout_s=TIMEOUT_S)
        self.stager = Stager(CPU)
        self.layouts: queue.Queue = queue.Queue()
        self.stager.relay = Relay("parent", lambda child, ready: self.layouts.put(ready))
        self.stager.relay.assign(["child"], [0])
        self.landed: list[int] = []  # bucket indices the child has, in order
        self.child_result: list = []

    def child(self) -> None:
        try:
            ready = self.layouts.get(timeout=TIMEOUT_S)
            flats = receive_flat(ready, CPU, 1, arrived=lambda i, flat: self.landed.append(i))
            self.child_result.append([f.clone() for f in flats])
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.child_result.append(e)

    def parent(self, ready, out: list) -> None:
        try:
            staged = self.stager.receive(ready)
            out.append(staged)
            self.stager.release()
        except Exception as e:  # noqa: BLE001 - the test reads it
            out.append(e)

    def push(self, version: int, weights, on_bucket) -> tuple[list, list, BaseException | None]:
        packed = pack(plan_buckets(weights, 64 * 64 * 4), weights, "cpu")
        assert len(packed) == 3
        parent_out: list = []
        threads = []

        def deliver(ready) -> None:
            threads.append(threading.Thread(target=self.parent, args=(ready, parent_out)))
            threads[-1].start()

        error = None
        try:
            push(self.sender, version, packed, deliver, on_bucket=on_bucket)
        except WeightTransferError as e:
            error = e
        for t in threads:
            t.join(timeout=TIMEOUT_S * 2)
        return [packed.get(i).clone() for i in range(len(packed))], parent_out, error

    def close(self) -> None:
        self.stager.relay.close()


@pytest.fixture
def tree():
    t = Tree()
    yield t
    t.close()


def test_the_child_has_each_bucket_before_the_parent_has_the_whole_version(tree):
    child = threading.Thread(target=tree.child)
    child.start()
    held_back = []

    def on_bucket(node_id: str, index: int) -> None:
        if index == 2:  # the last bucket waits until the child has the two before it
            deadline = time.monotonic() + TIMEOUT_S / 2
            while tree.landed != [0, 1] and time.monotonic() < deadline:
                time.sleep(0.01)
            held_back.append(list(tree.landed))

    sent, parent_out, error = tree.push(1, _weights(1), on_bucket)
    child.join(timeout=TIMEOUT_S * 2)
    assert error is None and not isinstance(parent_out[0], Exception), (error, parent_out)
    assert held_back == [[0, 1]]  # forwarded as they landed, while the parent's own receive was not done
    (received,) = tree.child_result
    assert not isinstance(received, Exception), received
    assert all(torch.equal(a, b) for a, b in zip(sent, received, strict=True))  # bit-exact through the relay


def test_a_parent_whose_receive_fails_mid_version_fails_its_childs_and_keeps_no_copy_of_it(tree):
    child = threading.Thread(target=tree.child)
    child.start()

    def on_bucket(node_id: str, index: int) -> None:
        if index == 2:
            deadline = time.monotonic() + TIMEOUT_S / 2
            while tree.landed != [0, 1] and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("the learner stops mid-version")  # its group is aborted: the parent's receive fails

    _, parent_out, error = tree.push(1, _weights(2), on_bucket)
    child.join(timeout=TIMEOUT_S * 3)
    assert isinstance(error, WeightTransferError) and isinstance(parent_out[0], WeightTransferError), parent_out
    assert tree.landed == [0, 1]
    (received,) = tree.child_result
    assert isinstance(received, WeightTransferError), received  # its parent's send failed under it
    assert tree.stager.relay._copies.latest is None  # withdrawn: no later child is given a version that failed
