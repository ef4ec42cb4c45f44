"""The `hf` node on a GPU takes a new version over NCCL while a long batch runs (learner cuda:0, node cuda:1).

As tests/integration/test_hf_staging.py on CPU: the learner's transfer ends while the batch still
runs, the batch keeps its version, the swap waits for the batch's end, the next batch samples the
new weights.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

PLANTED = 100


@pytest.fixture
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


def test_nccl_transfer_finishes_during_a_long_batch_and_the_swap_waits_for_its_end(
    two_gpus, tiny_model, planted_weights
):
    from streamrl.engine.config import ModelConfig, RolloutConfig
    from streamrl.engine.weights import WeightSender, plan_buckets
    from streamrl.rollout.backends.hf import HFBackend

    model_cfg = ModelConfig(max_model_len=1024, dtype="bfloat16")
    engine = HFBackend(tiny_model, model_cfg, RolloutConfig(max_tokens=800), device="cuda:1", static=False)
    state = planted_weights(engine.model, PLANTED, device="cuda:0")
    sender = WeightSender("gpu-hf", backend="nccl", device="cuda:0", timeout_s=60.0)
    ready = sender.prepare(1, plan_buckets(state, 1 << 20))
    sent: dict[str, float] = {}

    def learner():
        time.sleep(0.5)  # the batch is running by now
        sent["transfer_s"] = sender.send(state, ready)

    async def scenario():
        long = asyncio.ensure_future(engine.generate([3, 4, 5], n=64, max_tokens=800))
        await asyncio.sleep(0.1)
        thread = threading.Thread(target=learner)
        started = time.monotonic()
        thread.start()
        await engine.update_weights(ready)
        live_at = time.monotonic() - started
        first = await long
        batch_s = engine.clock.snapshot()[0]
        thread.join(timeout=60)
        after = await engine.generate([3, 4, 5], n=2, max_tokens=6)
        return first, after, live_at, batch_s

    first, after, live_at, batch_s = asyncio.run(scenario())
    print({"transfer_s": sent.get("transfer_s"), "batch_s": batch_s, "live_after_s": live_at})
    assert sent["transfer_s"] < 0.5 * batch_s, (sent, batch_s)
    assert all(set(c.token_versions) == {0} for c in first)
    assert all(c.token_ids == [PLANTED] * 6 and set(c.token_versions) == {1} for c in after)
    asyncio.run(engine.close())
