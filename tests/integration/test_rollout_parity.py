"""The vllm and hf backends report the same behavior logprobs: those of the distribution sampled from
(logits / T, top-k/top-p filtered and renormalised; vLLM's processed_logprobs), which the learner recomputes."""

from __future__ import annotations

import asyncio
import math

import pytest

from streamrl.engine.config import ModelConfig, RolloutConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [300, 12, 99, 100, 101, 7]]
MODEL = ModelConfig(max_model_len=128)


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> str:
    from streamrl.engine.models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "sharp", seed=1, initializer_range=0.2))


@pytest.fixture(scope="module")
def vllm_engine(sharp_model):
    """One vLLM engine for every sampling setting below (each request carries its own SamplingParams, made from
    the backend's `rollout` when it is sent), on an event loop of its own: the engine is bound to the loop it
    first ran in."""
    from streamrl.rollout.backends.vllm import VLLMBackend

    loop = asyncio.new_event_loop()
    engine = VLLMBackend(sharp_model, MODEL, RolloutConfig(), seed=0)
    yield engine, loop
    loop.run_until_complete(engine.close())
    loop.close()


def _hf(model: str, rollout: RolloutConfig):
    from streamrl.rollout.backends.hf import HFBackend

    return HFBackend(model, MODEL, rollout, seed=0)


def _generate_all(loop, engine, n: int, max_tokens: int):
    async def go():
        return await asyncio.gather(*(engine.generate(p, n, max_tokens) for p in PROMPTS))

    return loop.run_until_complete(go())


def _worst_gap(reference, prompts_and_groups) -> float:
    worst = 0.0
    for prompt, group in prompts_and_groups:
        for c in group:
            assert len(c.logprobs) == len(c.token_ids) == len(c.token_versions) > 0
            scored = reference.score(prompt, c.token_ids)
            worst = max(worst, max(abs(a - b) for a, b in zip(scored, c.logprobs)))
    return worst


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.7, top_p=0.8)],
    ids=["T0.7", "topk5", "T0.7-topp0.8"],
)
def test_vllm_and_hf_backends_agree_on_logprobs(loop, sharp_model, vllm_engine, sampling):
    rollout = RolloutConfig(**sampling)
    hf = _hf(sharp_model, rollout)
    hf_groups = _generate_all(loop, hf, n=3, max_tokens=10)
    vllm, vllm_loop = vllm_engine
    vllm.rollout = rollout  # this test's sampling settings, for the requests it sends
    assert vllm.sampling_params(3, 10).temperature == rollout.temperature
    vllm_groups = _generate_all(vllm_loop, vllm, n=3, max_tokens=10)
    # vLLM's tokens scored by the hf backend's definition, and the hf backend's own tokens likewise.
    assert _worst_gap(hf, zip(PROMPTS, vllm_groups)) < 1e-3
    assert _worst_gap(hf, zip(PROMPTS, hf_groups)) < 1e-3
    for groups in (vllm_groups, hf_groups):
        assert [len(g) for g in groups] == [3, 3, 3]
        for c in (c for g in groups for c in g):
            assert c.finish_reason in ("stop", "length") and c.token_versions == [0] * len(c.token_ids)
            if len(sampling) > 1:
                _assert_renormalised(hf, c, groups, rollout)
    _assert_the_learner_recomputes(hf, vllm_groups, rollout)


def _assert_renormalised(hf, completion, groups, rollout: RolloutConfig) -> None:
    """Sampled tokens are among the kept ones, and their logprob is renormalised over those: above the
    unfiltered log_softmax(logits / T) by -log(kept mass)."""
    import torch

    from streamrl.engine.sampling import keep_floor

    prompt = next(p for p, g in zip(PROMPTS, groups) if any(c is completion for c in g))
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        z = hf.model(ids).logits[0, len(prompt) - 1 : -1].float() / rollout.temperature
    kept = z >= keep_floor(z, rollout.top_k, rollout.top_p)[:, None]
    raw = z.log_softmax(-1)
    for pos, token in enumerate(completion.token_ids):
        assert kept[pos, token]
        kept_mass = raw[pos][kept[pos]].exp().sum().item()
        expected = raw[pos, token].item() - math.log(kept_mass)
        assert completion.logprobs[pos] == pytest.approx(expected, abs=1e-3)
        assert kept_mass < 0.99  # else renormalising would be invisible


def _assert_the_learner_recomputes(hf, groups, rollout: RolloutConfig) -> None:
    """The learner's policy model on the same weights gives vLLM's logprobs back: a fresh sample's ratio is 1."""
    import torch

    from streamrl.learner.logprobs import PolicyModel

    policy = PolicyModel(hf.model, temperature=rollout.temperature, top_k=rollout.top_k, top_p=rollout.top_p)
    worst = 0.0
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            tokens = torch.tensor(prompt + c.token_ids)
            n = tokens.numel() - 1
            with torch.no_grad():
                lp, _ = policy(tokens[:-1], torch.arange(n), tokens[1:], torch.tensor([0, n], dtype=torch.int32), n)
            worst = max(worst, max(abs(a - b) for a, b in zip(lp[len(prompt) - 1 :].tolist(), c.logprobs)))
    assert worst < 1e-3
