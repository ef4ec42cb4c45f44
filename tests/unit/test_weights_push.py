"""engine/weights/push.py, the learner's one order of steps for a push, on the shared-memory path in one process:
`push_in_process` hands the layout (with a LoRA adapter's spec when given) to an engine's receive on this loop while
the send runs in a thread, and returns the engine's seconds once both ended; a layout that cannot be delivered
fails as the push's 'layout' phase, naming the node, before anything is sent."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrl.engine.messages import AdapterSpec, WeightsReady
from streamrl.engine.weights import IpcSender, Stager, WeightTransferError, pack, plan_buckets, push, push_in_process


class FakeEngine:
    """Stands in for a backend's `update_weights` (stage, then swap): stages through the product's `Stager` in a
    thread, keeps what it staged and says it took 0.25 s."""

    def __init__(self) -> None:
        self.stager, self.staged, self.adapters = Stager("cpu"), {}, []

    async def update_weights(self, ready: WeightsReady) -> float:
        staged = await asyncio.to_thread(self.stager.receive, ready)
        self.staged = {name: t.clone() for name, t in staged.named}
        self.adapters.append(staged.adapter)
        self.stager.release()
        return 0.25


def test_a_version_reaches_an_engine_of_this_process_whole_with_its_adapter():
    state = {"embed": torch.arange(12.0).reshape(3, 4), "norm": torch.ones(4)}
    packed = pack(plan_buckets(state, 1 << 20), state, "cpu")
    state["norm"].fill_(7.0)  # packed already: what the caller does with its tensors afterwards never travels
    sender, engine = IpcSender("here", timeout_s=5.0), FakeEngine()
    spec = AdapterSpec(rank=8, alpha=16.0, target_modules=["q_proj"])
    seconds = asyncio.run(push_in_process(sender, 3, packed, engine.update_weights, adapter=spec))
    assert seconds == 0.25  # the engine's own figure
    assert torch.equal(engine.staged["embed"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(engine.staged["norm"], torch.ones(4))
    assert engine.adapters == [spec]
    sender.close()


def test_a_layout_that_cannot_be_delivered_fails_the_push_naming_the_node_before_any_send():
    state = {"w": torch.zeros(4)}
    packed = pack(plan_buckets(state, 1 << 20), state, "cpu")
    sender = IpcSender("gone", timeout_s=30.0)

    def deliver(ready: WeightsReady) -> None:
        raise ConnectionError("node gone")

    with pytest.raises(WeightTransferError, match="'layout'.*ConnectionError: node gone") as info:
        push(sender, 1, packed, deliver)  # at once: the send (a 30 s deadline) never began
    assert info.value.node_id == "gone"
    sender.close()
