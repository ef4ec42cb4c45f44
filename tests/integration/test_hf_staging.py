"""The `hf` node takes a new version while a long batch runs: the learner's part is the transfer alone.

A real `HFBackend` (tiny model, CPU) in a long `generate`; a real `WeightSender` over a real gloo group
pushes new weights meanwhile. The transfer ends while the batch is still running; the batch keeps the
version it started with; the swap happens between batches; the next batch samples the new weights.
"""

from __future__ import annotations

import asyncio
import threading
import time

from streamrl.engine.config import ModelConfig, RolloutConfig
from streamrl.engine.weights import WeightSender, plan_buckets
from streamrl.rollout.backends.hf import HFBackend

PLANTED = 100


def test_transfer_finishes_during_a_long_batch_and_the_swap_waits_for_its_end(tiny_model, planted_weights):
    engine = HFBackend(tiny_model, ModelConfig(max_model_len=512), RolloutConfig(max_tokens=400), device="cpu")
    sender = WeightSender("hf-node", timeout_s=30.0)
    state = planted_weights(engine.model, PLANTED)
    ready = sender.prepare(1, plan_buckets(state, 64 * 1024))
    sent: dict[str, float] = {}

    def learner():
        time.sleep(0.3)  # the batch is running by now
        start = time.monotonic()
        sent["transfer_s"] = sender.send(state, ready)
        sent["done_at"] = time.monotonic() - start

    async def scenario():
        long = asyncio.ensure_future(engine.generate([3, 4, 5], n=8, max_tokens=400))
        await asyncio.sleep(0.1)
        thread = threading.Thread(target=learner)
        started = time.monotonic()
        thread.start()
        live_s = await engine.update_weights(ready)
        live_at = time.monotonic() - started
        first = await long
        batch_done = engine.clock.snapshot()[0]
        thread.join(timeout=30)
        after = await engine.generate([3, 4, 5], n=2, max_tokens=6)
        return first, after, live_s, live_at, batch_done

    first, after, live_s, live_at, generate_s = asyncio.run(scenario())
    print({"transfer_s": sent.get("transfer_s"), "batch_s": generate_s, "live_after_s": live_at})
    assert "transfer_s" in sent, "the learner's transfer did not finish"
    # the learner was held for the transfer, not for the batch: well under the batch's own time
    assert sent["transfer_s"] < 0.5 * generate_s and sent["transfer_s"] < 5.0, (sent, generate_s)
    assert live_at >= sent["transfer_s"]  # live only after the batch ended (the swap waits for it)
    assert all(c.token_versions == [0] * len(c.token_ids) for c in first)  # the batch kept its version
    assert all(c.token_ids == [PLANTED] * 6 and set(c.token_versions) == {1} for c in after)
    assert engine.policy_version == 1 and engine.clock.swap_s > 0 and live_s > 0
    asyncio.run(engine.close())
