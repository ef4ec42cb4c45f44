"""`loss.preset` (engine/config/presets.py): a recipe's [loss] fields, explicit settings winning, printed in full;
and the renamed `learner.updates_per_batch` refused with its new name."""

import tomllib

import pytest

from streamrl.engine.config import ConfigError, LossConfig, build, dump, presets


def test_dapo_sets_its_recipe_and_an_explicit_field_wins():
    cfg = build({"rollout": {"max_tokens": 20}}, ["loss.preset='dapo'", "loss.clip_high=0.3"])
    loss = cfg.loss
    assert (loss.clip_low, loss.clip_high, loss.aggregation, loss.advantage) == (0.2, 0.3, "token", "group_std")
    assert loss.dynamic_sampling and not loss.mask_truncated
    assert (loss.overlong_buffer, loss.overlong_penalty) == (4, 1.0)  # a fifth of max_tokens, as 4096 of 20480
    line = presets.describe(cfg)
    assert line.startswith("loss.preset = 'dapo': ")
    assert "clip_high = 0.3 (explicit; the preset's 0.28)" in line and "dynamic_sampling = True," in line
    assert all(f"{field} = " in line for field in presets.FIELDS)  # every field the preset names, in full


def test_every_preset_names_the_same_fields_so_switching_leaves_nothing_behind():
    for name in presets.PRESETS:
        cfg = build({}, [f"loss.preset='{name}'"])
        assert set(presets.values(name, cfg)) == set(presets.FIELDS)
    assert build({}, ["loss.preset='grpo'"]).loss.aggregation == "sequence"
    assert build({}, ["loss.preset='grpo'"]).loss.clip_high == 0.2  # symmetric, as TRL's epsilon alone
    gspo = build({}, ["loss.preset='gspo'"]).loss
    assert (gspo.ratio_level, gspo.clip_low, gspo.clip_high) == ("sequence", 3e-4, 4e-4)


def test_dr_grpo_divides_by_the_completion_limit_and_keeps_the_mean_baseline():
    loss = build({"rollout": {"max_tokens": 64}}, ["loss.preset='dr_grpo'"]).loss
    assert (loss.aggregation, loss.norm_constant, loss.advantage) == ("constant", 64.0, "group_mean")
    # an episode's completion runs to env.max_total_tokens
    episode = build({"env": {"name": "echo_target", "max_total_tokens": 300}}, ["loss.preset='dr_grpo'"])
    assert episode.loss.norm_constant == 300.0


def test_no_preset_changes_nothing_and_the_dump_round_trips():
    assert build({}).loss == LossConfig()
    assert presets.describe(build({})) == "loss.preset: none (every [loss] field as configured)"
    cfg = build({}, ["loss.preset='dapo'", "loss.overlong_buffer=2"])
    assert build(tomllib.loads(dump(cfg))) == cfg


def test_an_unknown_preset_and_the_renamed_field_are_refused_naming_the_fix():
    allowed = "'', 'grpo', 'dapo', 'dr_grpo', 'gspo', 'ppo', 'cispo', 'sapo', 'gmpo'"
    with pytest.raises(ConfigError, match=rf"loss.preset.*allowed: {allowed}"):
        build({}, ["loss.preset='vespo'"])
    with pytest.raises(ConfigError, match=r"`learner.updates_per_batch` was renamed: use learner.mini_batches"):
        build({"learner": {"updates_per_batch": 2}})
    assert build({}, ["learner.mini_batches=2", "learner.epochs=3"]).learner.epochs == 3
