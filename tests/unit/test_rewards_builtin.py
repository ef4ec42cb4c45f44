"""Built-in rewards, the combination rule and the scorer's column handling, run inline (no pool)."""

from __future__ import annotations

import pytest

from streamrl.engine.config import RewardConfig
from streamrl.rewards import Scorer, combine, demo_rows, letter_share
from streamrl.rewards.builtin import exact_match, make_length_penalty, make_regex
from streamrl.rewards.registry import RewardSpecError, resolve


def inline(**fields) -> Scorer:
    return Scorer(RewardConfig(workers=0, **fields))


def test_demo_reward_is_the_share_of_answer_letters():
    # "a a b" -> non-whitespace chars a,a,b -> 2/3; "" -> 0.0; "  " -> 0.0; "xyz" -> 0/3
    scorer = inline(functions=["demo"])
    rewards = scorer.score(["p"] * 4, ["a a b", "", "  ", "xyz"], [[1], [], [2], [3]], [{"answer": "a"}] * 4)
    assert rewards == pytest.approx([2 / 3, 0.0, 0.0, 0.0])
    assert letter_share("bbbb", "b") == 1.0


def test_copy_reward_is_the_f1_of_the_completions_words_against_the_prompts():
    scorer = inline(functions=["copy"])
    prompt = "sun red sun dog"
    completions = ["sun red sun dog", "dog sun", "sun sun sun sun sun sun", "cat cat", "", "red dog sun sun cat"]
    rewards = scorer.score([prompt] * 6, completions, [[1]] * 6, [{"answer": "a"}] * 6)
    # exact (any order) 1; 2 of 2 said, 2 of 4 asked: 2 * 1 * 0.5 / 1.5; sun counted twice at most: 2/6 and 2/4;
    # nothing matching, nothing said: 0; all 4 asked among 5 said: 2 * 0.8 * 1 / 1.8
    assert rewards == pytest.approx([1.0, 2 / 3, 2 * (1 / 3) * 0.5 / (1 / 3 + 0.5), 0.0, 0.0, 1.6 / 1.8])


def test_demo_rows_are_seeded_and_answer_a():
    rows = demo_rows(5, seed=3)
    assert rows == demo_rows(5, seed=3)
    assert rows != demo_rows(5, seed=4)
    assert all(r["answer"] == "a" and 3 <= len(r["prompt"].split()) <= 8 for r in rows)
    with pytest.raises(ValueError, match="n = -1"):
        demo_rows(-1)


def test_exact_match_ignores_surrounding_and_repeated_whitespace():
    out = exact_match(prompts=["p"] * 3, completions=[" 42 ", "4 2", "forty  two"], answer=["42", "42", "forty two"])
    assert out == [1.0, 0.0, 1.0]


def test_regex_matches_anywhere_across_lines():
    fn = make_regex(r"<answer>.*</answer>")
    assert fn(prompts=["p"] * 2, completions=["x <answer>1\n2</answer>", "<answer>"], completion_ids=[[], []]) == [
        1.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="reward.regex"):
        make_regex("(")
    with pytest.raises(RewardSpecError, match="'regex'.*reward.regex"):
        resolve("regex", RewardConfig())


def test_length_penalty_is_zero_to_target_then_linear_to_minus_one():
    fn = make_length_penalty(4)
    # 3 tokens -> 0; 4 -> 0; 6 -> -(2/4) = -0.5; 20 -> -min(1, 16/4) = -1
    ids = [[0] * 3, [0] * 4, [0] * 6, [0] * 20]
    assert fn(prompts=["p"] * 4, completions=[""] * 4, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0]


def test_combine_is_a_weighted_sum_and_none_wins():
    # sample 0: 0.5*1 + 2*0.25 = 1.0; sample 1: None in the second component -> None
    assert combine([[1.0, 1.0], [0.25, None]], [0.5, 2.0]) == [1.0, None]


def test_scorer_combines_with_weights():
    scorer = inline(functions=["demo", "exact_match"], weights=[1.0, 10.0])
    # "a" -> demo 1.0, exact 1.0 -> 11; "ab" -> demo 0.5, exact 0 -> 0.5
    assert scorer.score(["p", "p"], ["a", "ab"], [[1], [1, 2]], [{"answer": "a"}] * 2) == [11.0, 0.5]
    assert scorer.stats.calls == 1 and scorer.stats.samples == 2 and scorer.stats.none == 0


def test_scorer_rejects_mismatched_inputs_naming_the_problem():
    scorer = inline(functions=["demo"])
    with pytest.raises(ValueError, match="1 column rows for 2 completions"):
        scorer.score(["p", "p"], ["a", "b"], [[1], [2]], [{"answer": "a"}])
    with pytest.raises(ValueError, match=r"columns\[1\] has keys"):
        scorer.score(["p", "p"], ["a", "b"], [[1], [2]], [{"answer": "a"}, {"other": 1}])


def test_unknown_spec_names_the_choices():
    with pytest.raises(RewardSpecError, match="'nope' is not a registry name"):
        resolve("nope", RewardConfig())
    with pytest.raises(RewardSpecError, match="cannot import module"):
        resolve("no_such_module_xyz:fn", RewardConfig())


def test_prompt_columns_are_left_out_and_the_answer_column_is_aliased():
    # the rollout passes whole dataset rows: their `prompt` must not clash with the positional prompts
    scorer = Scorer(RewardConfig(functions=["exact_match"], workers=0), answer_column="solution")
    rows = [{"prompt": "2+2?", "solution": "4"}, {"prompt": "2+2?", "solution": "4"}]
    assert scorer.score(["2+2?"] * 2, ["4", "5"], [[1], [2]], rows) == [1.0, 0.0]
    assert scorer.stats.errors == 0
