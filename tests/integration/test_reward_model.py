"""Reward-model scoring with real tiny HF models (transformers forward passes on CPU)."""

from __future__ import annotations

import logging

import pytest
import torch

from streamrl.engine.config import RewardConfig, RewardModelConfig
from streamrl.rewards import build_scorer
from streamrl.rewards.model import PROBES, RewardModel

SAMPLES = [("What is 1 + 1?", " 2"), ("What is 1 + 1?", " three"), ("Pick a word.", " moon"), ("Pick a word.", "")]
TARGETS = [-15.0, -12.0, -10.0, -8.0]  # the raw logits the tiny reward model is built to give SAMPLES


@pytest.fixture(scope="module")
def tiny_reward_model(tiny_model, tmp_path_factory) -> str:
    """A Qwen2 sequence classifier whose head is solved so that SAMPLES score exactly TARGETS (and the
    start-up probes land in [-15, -8] too): least squares on the last token's hidden state."""
    from transformers import AutoModelForSequenceClassification

    from streamrl.engine.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1).eval()
    pairs = SAMPLES + PROBES
    targets = torch.tensor(TARGETS + [-15.0 + 7.0 * i / (len(PROBES) - 1) for i in range(len(PROBES))])
    enc = tokenizer([p + c for p, c in pairs], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model.model(**enc).last_hidden_state  # [N, T, H]
    last = hidden[torch.arange(len(pairs)), enc["attention_mask"].sum(1) - 1].double()  # [N, H]
    weight = torch.linalg.lstsq(last, targets.double().unsqueeze(1)).solution  # [H, 1]
    model.score.weight.data.copy_(weight.T.float())
    folder = tmp_path_factory.mktemp("reward_model") / "rm"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def rm_config(path: str, **fields) -> RewardModelConfig:
    return RewardModelConfig(path=path, device="cpu", batch_size=3, **fields)


def test_raw_scores_in_minus_15_to_minus_8_are_mapped_into_the_configured_range(tiny_reward_model, caplog):
    cfg = rm_config(tiny_reward_model, transform="sigmoid", shift=11.5, clip_low=0.0, clip_high=1.0)
    with caplog.at_level(logging.WARNING, "streamrl.rewards"):
        model = RewardModel(cfg)
    assert not caplog.records, "probes in range must not warn"
    prompts, completions = map(list, zip(*SAMPLES))
    assert model.raw_scores(prompts, completions).tolist() == pytest.approx(TARGETS, abs=1e-3)
    # sigmoid(raw + 11.5): -15 -> sigmoid(-3.5) = 0.029312; -12 -> sigmoid(-0.5) = 0.377541;
    # -10 -> sigmoid(1.5) = 0.817574; -8 -> sigmoid(3.5) = 0.970688
    assert model.score(prompts, completions) == pytest.approx([0.029312, 0.377541, 0.817574, 0.970688], abs=1e-3)


def test_a_model_far_outside_the_range_warns_at_start_naming_the_fix(tiny_reward_model, caplog):
    with caplog.at_level(logging.WARNING, "streamrl.rewards"):
        model = RewardModel(rm_config(tiny_reward_model, clip_low=-1.0, clip_high=1.0))
    assert any(
        "far outside" in r.getMessage() and "reward.model.scale / shift" in r.getMessage() for r in caplog.records
    )
    assert model.score(*map(list, zip(*SAMPLES))) == [-1.0] * 4  # raw -15..-8 clipped flat: why it warned


def test_reward_model_combines_with_functions_in_the_scorer(tiny_reward_model):
    cfg = RewardConfig(
        functions=["reward_model", "demo"],
        weights=[2.0, 1.0],
        workers=1,
        model=rm_config(tiny_reward_model, transform="tanh", scale=0.5, shift=5.75, clip_low=-1.0, clip_high=1.0),
    )
    with build_scorer(cfg) as scorer:
        prompts, completions = map(list, zip(*SAMPLES))
        rewards = scorer.score(prompts, completions, [[1]] * 4, [{"answer": "o"}] * 4)
    # tanh(0.5 * raw + 5.75): -15 -> tanh(-1.75) = -0.941376; -12 -> tanh(-0.25) = -0.244919;
    # -10 -> tanh(0.75) = 0.635149; -8 -> tanh(1.75) = 0.941376. demo share of "o": "2" 0, "three" 0,
    # "moon" 2/4, "" 0. total = 2 * rm + demo
    expected = [2 * -0.941376, 2 * -0.244919, 2 * 0.635149 + 0.5, 2 * 0.941376]
    assert rewards == pytest.approx(expected, abs=2e-3)


def test_a_causal_lm_judge_scores_one_tokens_logit_at_the_last_position(tiny_model):
    from transformers import AutoModelForCausalLM

    from streamrl.engine.models import load_tokenizer

    model = RewardModel(
        rm_config(tiny_model, kind="causal_lm", token="a", clip_low=-100.0, clip_high=100.0), probe=False
    )
    tokenizer = load_tokenizer(tiny_model)
    token = tokenizer.encode("a", add_special_tokens=False)[0]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    texts = [p + c for p, c in SAMPLES if p + c]
    with torch.no_grad():  # each text alone, unpadded: what batching with padding must reproduce
        expected = [float(reference(**tokenizer(t, return_tensors="pt")).logits[0, -1, token]) for t in texts]
    prompts, completions = map(list, zip(*SAMPLES))
    assert model.raw_scores(prompts, completions).tolist() == pytest.approx(expected, abs=1e-4)


def test_bad_reward_model_settings_name_the_field(tiny_model, tiny_reward_model):
    with pytest.raises(ValueError, match="reward.model.token = 'alpha beta' is 2 tokens|is 3 tokens"):
        RewardModel(rm_config(tiny_model, kind="causal_lm", token="alpha beta"), probe=False)
    with pytest.raises(ValueError, match="reward.model.index = 5 but the reward model has 1 classes"):
        RewardModel(rm_config(tiny_reward_model, index=5), probe=False)
    with pytest.raises(ValueError, match="reward.model.path is empty"):
        RewardModel(RewardModelConfig())
