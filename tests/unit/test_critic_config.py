"""`loss.preset = "ppo"`, the rules that tie the critic to GAE, and the critic in the learner's memory estimate."""

import pytest

from streamrl.engine import memory
from streamrl.engine.config import build, presets
from streamrl.engine.config import rules as config_rules

PPO = {"loss": {"preset": "ppo"}, "rollout": {"group_size": 1}}


def errors(data):
    return [f.message for f in config_rules.check(build(data)) if f.level == "error"]


def test_the_ppo_preset_sets_gae_and_prints_the_critic_half_of_the_recipe():
    cfg = build(PPO)
    assert (cfg.loss.advantage, cfg.loss.aggregation, cfg.loss.clip_low, cfg.loss.clip_high) == (
        "gae",
        "token",
        0.2,
        0.2,
    )
    assert (cfg.critic.gamma, cfg.critic.lam_actor, cfg.critic.lam_critic) == (1.0, 0.95, 1.0)
    line = presets.describe(cfg)
    for part in ("advantage = 'gae'", "critic.gamma = 1.0", "critic.lam_actor = 0.95", "critic.lam_critic = 1.0"):
        assert part in line, line
    assert errors(PPO) == []  # a group of one is fine with a critic


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"loss": {"advantage": "gae"}, "critic": {"enabled": False}}, "needs the critic's values"),
        ({"critic": {"enabled": True}}, "only GAE uses the critic's values"),
        ({"rollout": {"group_size": 1}}, "a group of one is its own baseline"),
        ({**PPO, "loss": {"preset": "ppo", "dynamic_sampling": True}}, "never has reward variance"),
    ],
)
def test_each_misfit_is_refused_in_one_line_naming_the_fields(data, fragment):
    found = errors(data)
    assert len(found) == 1 and fragment in found[0], found
    assert "\n" not in found[0]


def test_the_learner_estimate_counts_the_critic():
    shape = memory.Shape(params=494_000_000, hidden=896, intermediate=4864, layers=24, kv_width=128, vocab=151936)
    grpo, ppo = memory.learner(build({}), shape), memory.learner(build(PPO), shape)
    # the critic: 16 bytes a parameter (fp32 weights, gradients, two AdamW moments) + its 2-byte compute copy
    assert ppo.gib - grpo.gib == pytest.approx(18 * 494_000_000 / 2**30)


def test_a_kl_in_the_reward_counts_the_reference_model():
    shape = memory.Shape(params=494_000_000, hidden=896, intermediate=4864, layers=24, kv_width=128, vocab=151936)
    ppo = memory.learner(build(PPO), shape)
    penalised = memory.learner(build({**PPO, "critic": {"kl_in_reward": 0.01, "kl_ctrl": "adaptive"}}), shape)
    # learner/reference.py builds the reference for critic.kl_in_reward as for loss.kl_coef: in model.dtype
    # (float32 here), its shards over one rank + its gathered copy, 494,000,000 x (4 + 4) bytes
    line = memory.reference_label(build(PPO))
    assert penalised.parts[line] == 8 * 494_000_000 / 2**30 and line not in ppo.parts


def test_a_lora_critic_counts_its_frozen_base_and_its_adapters_not_a_full_critic():
    # Qwen2.5-7B's shape, bf16, one rank: a full critic is 18 bytes a parameter (128 GiB), more than a GPU holds
    shape = memory.Shape(params=7_615_616_512, hidden=3584, intermediate=18944, layers=28, kv_width=512, vocab=152064)
    lora = {"model": {"dtype": "bfloat16"}, "lora": {"enabled": True, "rank": 16}}
    full = memory.learner(build({**PPO, **lora, "critic": {"lora": False}}), shape)
    small = memory.learner(build({**PPO, **lora}), shape)  # critic.lora auto: as the actor
    line = "critic: frozen base (model.dtype), adapters, gradients, AdamW"
    assert full.parts["critic: weights, gradients, AdamW"] == pytest.approx(18 * shape.params / 2**30)
    a = memory.adapter_params(build(lora), shape)
    assert small.parts[line] == pytest.approx((4 * shape.params + 18 * a) / 2**30)  # its shards + gathered copy
    assert small.parts[line] < 0.25 * full.parts["critic: weights, gradients, AdamW"]  # 29 GiB against 128
