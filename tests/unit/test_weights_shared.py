"""The shared-memory path (engine/weights/ipc.py) between an `IpcSender` and a `Stager`, in one process
(the node maps the learner's memfd by its /proc path, as a process of the same machine does).

What it promises: every version arrives bit-exact, including into new buffers at a freed one's
address; a node that cannot open the buffers fails at once (phase 'open', not the deadline), naming
the fix; whichever side claims a version's confirmation first decides, so a copy that ends after the
learner gave up is thrown away.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streamrl.engine import messages
from streamrl.engine.weights import IpcSender, Stager, WeightTransferError, pack, plan_buckets


def _state(version: int) -> dict[str, torch.Tensor]:
    embed = torch.arange(600, dtype=torch.float32).reshape(30, 20) + version
    return {"embed": embed, "norm": torch.full((20,), float(version)), "head": embed, "half": embed[:2].bfloat16()}


def _push(
    sender: IpcSender, stager: Stager, version: int, addresses: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """One version through the shared path, in new buffers; the staged tensors by name (`addresses` gets the
    buffers')."""
    state = _state(version)
    packed = pack(plan_buckets(state, 1024), state, "cpu")
    if addresses is not None:
        addresses += [packed.get(i).data_ptr() for i in range(len(packed))]
    ready = messages.decode_control(messages.encode(sender.prepare(version, packed)))  # as it crosses the wire
    got: dict = {}
    node = threading.Thread(target=lambda: got.update(staged=stager.receive(ready)))
    node.start()
    sender.send(packed, ready)
    node.join(10)
    staged = got["staged"]
    named = {name: t.clone() for name, t in staged.named}
    stager.release()
    assert staged.version == version and staged.path == "shm"
    return named


def test_versions_arrive_bit_exact_also_into_new_buffers_at_a_freed_ones_address():
    sender, stager = IpcSender("n", timeout_s=5.0), Stager("cpu")
    seen: list[int] = []
    for version in range(1, 5):  # a new pool each time: freed buffers' addresses come back
        addresses: list[int] = []
        got = _push(sender, stager, version, addresses)
        for name, t in _state(version).items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), (version, name)
        reused = set(addresses) & set(seen)
        seen += addresses
    # what the test is about happened: the last version's buffers sat at addresses an earlier one had
    assert reused, seen


def test_a_node_that_cannot_open_the_buffers_fails_at_once_naming_the_fix():
    sender, stager = IpcSender("far", timeout_s=30.0), Stager("cpu")
    state = _state(1)
    packed = pack(plan_buckets(state, 1 << 20), state, "cpu")
    ready = sender.prepare(1, packed)
    ready.shared[0].path, ready.shared[0].key = "/proc/1/fd/999999", "elsewhere"  # another PID namespace
    with pytest.raises(WeightTransferError, match="'open'.*weights.backend = 'gloo'"):
        stager.receive(ready)
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match="'open'.*cannot open the learner's shm buffers") as info:
        sender.send(packed, ready)
    assert info.value.node_id == "far" and time.monotonic() - start < 1.0  # its word, not the 30 s deadline


def test_a_copy_that_ends_after_the_learner_gave_up_is_thrown_away():
    sender, stager = IpcSender("late", timeout_s=0.3), Stager("cpu")
    state = _state(1)
    packed = pack(plan_buckets(state, 1 << 20), state, "cpu")
    ready = sender.prepare(1, packed)
    with pytest.raises(WeightTransferError, match="'copy'.*no confirmation within 0.3 s"):
        sender.send(packed, ready)  # the node never came: the learner claims the version's key
    with pytest.raises(WeightTransferError, match="gave up on version 1 first"):
        stager.receive(ready)  # the node comes late: its copy must not go live
    assert _push(sender, stager, 2)["norm"][0] == 2.0  # and the next one does
