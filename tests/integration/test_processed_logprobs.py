"""Behaviour logprobs with top-p / top-k (the hf backend, real generate) are those of the distribution sampled
from, and the learner's policy model recomputes them: the importance ratio of a fresh sample is 1."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrl.engine.config import ModelConfig, RolloutConfig

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [300, 12, 99, 100, 101, 7]]


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory) -> str:
    from streamrl.engine.models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "sharp", seed=1, initializer_range=0.2))


@pytest.fixture(scope="module")
def hub_defaults_model(sharp_model, tmp_path_factory) -> str:
    """The sharp model with a generation_config as a hub model ships one (Qwen2.5's has repetition_penalty 1.05,
    top_k 20, temperature 0.7), strong enough to change every distribution if generate applied it."""
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path_factory.mktemp("models") / "hub-defaults"
    shutil.copytree(sharp_model, folder, dirs_exist_ok=True)
    hub = GenerationConfig(do_sample=True, repetition_penalty=3.0, top_k=2, temperature=0.3, min_p=0.2,
                           no_repeat_ngram_size=1, eos_token_id=0, pad_token_id=0)  # fmt: skip
    hub.save_pretrained(folder)
    return str(folder)


def learner_logprobs(lm, sampling: RolloutConfig, prompt: list[int], completion: list[int]) -> list[float]:
    """The learner's logprobs of `completion` (one packed sequence through PolicyModel, as a step computes them)."""
    from streamrl.learner.logprobs import PolicyModel

    policy = PolicyModel(lm, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    tokens = torch.tensor(prompt + completion)
    n = tokens.numel() - 1
    with torch.no_grad():
        lp, _ = policy(tokens[:-1], torch.arange(n), tokens[1:], torch.tensor([0, n], dtype=torch.int32), n)
    return lp[len(prompt) - 1 :].tolist()


@pytest.mark.parametrize(
    "sampling",
    [RolloutConfig(temperature=0.7, top_p=0.8), RolloutConfig(temperature=1.2, top_k=6, top_p=0.9)],
    ids=["T0.7-p0.8", "T1.2-k6-p0.9"],
)
def test_hf_behaviour_logprobs_are_the_sampled_distributions_and_the_learner_recomputes_them(sharp_model, sampling):
    check_behaviour_logprobs(sharp_model, sampling)


def test_a_models_own_generation_config_does_not_change_what_the_hf_node_samples(hub_defaults_model):
    """Only the run's sampling applies (as vLLM's SamplingParams): a repetition penalty, top-k or min-p from the
    model folder would make the behaviour logprobs differ from what the learner recomputes."""
    check_behaviour_logprobs(hub_defaults_model, RolloutConfig(temperature=1.2, top_k=6, top_p=0.9))


def check_behaviour_logprobs(model: str, sampling: RolloutConfig) -> None:
    from streamrl.rollout.backends.hf import HFBackend

    backend = HFBackend(model, ModelConfig(max_model_len=128), sampling, seed=0)

    async def generate():
        return await asyncio.gather(*(backend.generate(p, 3, 12) for p in PROMPTS))

    groups = asyncio.run(generate())
    worst, shifted = 0.0, []
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            ours = learner_logprobs(backend.model, sampling, prompt, c.token_ids)
            worst = max(worst, max(abs(a - b) for a, b in zip(ours, c.logprobs)))
            with torch.no_grad():  # the unfiltered log_softmax(logits / T), what the behaviour logprob was before
                logits = backend.model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            raw = logits.float().div(sampling.temperature).log_softmax(-1)
            raw = raw.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
            shifted += [b - a for a, b in zip(raw.tolist(), c.logprobs)]
    assert worst < 1e-4  # mu (what generate sampled from) = the learner's pi on the same weights
    # renormalised over the kept tokens: higher than the unfiltered value by -log(kept mass), visibly so
    assert min(shifted) > -1e-5 and sum(shifted) / len(shifted) > 0.01
