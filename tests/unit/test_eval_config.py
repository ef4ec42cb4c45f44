"""The [eval] section: which versions are evaluated, the sampling of evaluation requests, refused values."""

import pytest

from streamrl.engine.config import ConfigError, build
from streamrl.engine.config.eval import due, reward_config, sampling, source_data

SOURCE = {"name": "held", "path": "held.jsonl"}


def test_off_without_sources():
    cfg = build({})
    assert not cfg.eval.enabled and not due(cfg.eval, 0, 10) and not due(cfg.eval, 10, 10)


def test_due_versions():
    cfg = build({"eval": {"every": 4, "sources": [SOURCE]}}).eval
    assert [v for v in range(0, 11) if due(cfg, v, last_version=10)] == [0, 4, 8, 10]
    quiet = build({"eval": {"before_training": False, "sources": [SOURCE]}}).eval
    assert [v for v in range(0, 11) if due(quiet, v, last_version=10)] == [10]  # the last always


def test_greedy_is_top_k_one_and_sources_default_to_data_columns():
    cfg = build({"data": {"prompt_column": "q"}, "rollout": {"max_tokens": 24}, "eval": {"sources": [SOURCE]}})
    greedy = sampling(cfg.eval, cfg.rollout)
    got = (greedy.temperature, greedy.top_k, greedy.top_p, greedy.max_tokens, greedy.group_size)
    assert got == (1.0, 1, 1.0, 24, 1)
    sampled = sampling(build({"eval": {"n": 8, "temperature": 0.6, "top_p": 0.9, "max_tokens": 7}}).eval, cfg.rollout)
    assert (sampled.temperature, sampled.top_k, sampled.top_p, sampled.max_tokens, sampled.group_size) == (
        0.6, 0, 0.9, 7, 8)  # fmt: skip
    data = source_data(cfg.eval.sources[0], cfg.data)
    assert (data.path, data.prompt_column, data.loop, data.shuffle) == ("held.jsonl", "q", False, False)


def test_reward_functions_default_to_the_runs():
    cfg = build({"reward": {"functions": ["demo", "format"], "weights": [1.0, 0.5]}, "eval": {"functions": ["math"]}})
    given = reward_config(cfg.eval, cfg.reward)
    assert given.functions == ["math"] and given.weights == []
    assert reward_config(build({}).eval, cfg.reward) is cfg.reward


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"n": 0}, "eval.n"),
        ({"temperature": -0.1}, "eval.temperature"),
        ({"sources": [{"name": "a b", "path": "x"}]}, "eval.sources[0].name"),
        ({"sources": [{"name": "a", "path": ""}]}, "eval.sources[0].path"),
        ({"sources": [SOURCE, SOURCE]}, "more than once"),
        ({"sources": [{"name": "a", "file": "x"}]}, "allows: name, path"),
    ],
)
def test_bad_values_name_the_field(section, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        build({"eval": section})


def test_the_demo_implies_its_held_out_evaluation():
    from streamrl.rollout.evaluation_prompts import DEMO_EVAL, demo_implied

    assert demo_implied({}, build({}))[0] == DEMO_EVAL
    demo = build({}, DEMO_EVAL).eval
    assert [s.path for s in demo.sources] == ["demo:heldout"] and demo.pass_threshold == 0.5
    given = {"eval": {"sources": []}}  # an [eval] of the user's own, even an empty one, is kept
    assert demo_implied(given, build(given)) == ([], "")
    for other in ({"data": {"path": "x.jsonl"}}, {"reward": {"functions": ["copy"]}}):
        assert demo_implied(other, build(other)) == ([], "")
