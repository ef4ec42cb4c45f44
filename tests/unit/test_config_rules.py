"""Cross-section config rules (engine/config/rules.py): one place, called by the learner and by preflight."""

import pytest

from streamrl.engine.config import ConfigError, build
from streamrl.engine.config import rules as config_rules
from streamrl.learner.main import check_config
from streamrl.ops import preflight


def messages(*overrides: str, roles=config_rules.ROLES) -> list[str]:
    return [str(f) for f in config_rules.check(build({}, list(overrides)), roles)]


def test_the_defaults_pass():
    assert messages() == []


def test_a_sample_longer_than_the_micro_batch_budget_is_refused_at_start():
    # longest sample: min(512, 256 + 32) = 288 tokens = 287 positions (the last token is only a target)
    (found,) = messages("learner.micro_batch_tokens=200")
    assert found == (
        "error: learner.micro_batch_tokens = 200 is below the longest sample (287 positions: "
        "min(model.max_model_len, data.max_prompt_tokens + rollout.max_tokens) - 1), which the learner could "
        "not pack; raise it to at least 287 or lower the lengths"
    )
    assert messages("learner.micro_batch_tokens=287") == []
    assert messages("learner.micro_batch_tokens=200", roles=("rollout",)) == []  # the learner's rule
    # generation stops at model.max_model_len: min(300, 256 + 200) - 1 = 299
    assert (
        "(299 positions"
        in messages("learner.micro_batch_tokens=200", "model.max_model_len=300", "rollout.max_tokens=200")[0]
    )
    # a multi-turn episode is bounded by env.max_total_tokens after its first prompt: min(512, 256 + 1024) - 1
    (found,) = messages("learner.micro_batch_tokens=300", "env.name='echo_target'")
    assert "(511 positions: min(model.max_model_len, data.max_prompt_tokens + env.max_total_tokens) - 1)" in found


def test_ranks_and_updates_need_enough_samples_per_step():
    # 4 groups x 4 completions = 16 samples per step
    (ranks,) = messages("learner.ranks=17")
    assert ranks.startswith("error: learner.ranks = 17 exceeds the samples of a step")
    (updates,) = messages("learner.mini_batches=17")
    assert updates.startswith(
        "error: learner.mini_batches = 17 exceeds the samples of a step "
        "(learner.groups_per_step x rollout.group_size = 16)"
    )
    assert messages("learner.mini_batches=16", "learner.ranks=16") == []
    assert messages("learner.epochs=40") == []  # passes re-use the mini-batches: no sample count limits them


def test_recipe_rules_name_their_fields():
    (buffer,) = messages("loss.overlong_buffer=40")  # rollout.max_tokens is 32
    assert buffer.startswith(
        "error: loss.overlong_buffer = 40 exceeds the longest completion (32 tokens: rollout.max_tokens)"
    )
    assert messages("loss.overlong_buffer=32") == []
    (gspo,) = messages("loss.ratio_level='sequence'")
    assert gspo.startswith("warning: loss.ratio_level = 'sequence' (GSPO) with one update per step")
    assert messages("loss.ratio_level='sequence'", "learner.mini_batches=4") == []
    (cispo,) = messages("loss.preset='cispo'")
    assert cispo.startswith("warning: loss.surrogate = 'cispo' with one update per step")
    assert messages("loss.preset='cispo'", "learner.epochs=2") == []


def test_a_reference_without_kl_is_a_warning_and_readmit_an_error():
    (found,) = messages("loss.reference_path='/models/ref'")
    assert found.startswith("warning: loss.reference_path = '/models/ref' but loss.kl_coef = 0: no reference")
    assert messages("loss.reference_path='/models/ref'", "loss.kl_coef=0.1") == []
    (found,) = messages("ledger.on_node_lost='readmit'")
    assert found.startswith("error: ledger.on_node_lost = 'readmit'")


def test_the_learner_and_preflight_apply_the_same_rules():
    cfg = build({}, ["learner.mini_batches=17", "learner.micro_batch_tokens=200"])
    with pytest.raises(ConfigError) as refused:
        check_config(cfg)
    found = config_rules.check(cfg, ("learner",))
    assert str(refused.value) == "; ".join(f.message for f in found) and len(found) == 2
    report = preflight.check_config(preflight._Context(cfg=cfg, roles=frozenset({"learner"})))
    assert [p.message for p in report] == [f.message for f in found]
    check_config(build({}, ["loss.reference_path='/models/ref'"]))  # a warning does not stop the learner
