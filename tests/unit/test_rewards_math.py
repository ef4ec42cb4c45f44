"""math-verify equivalences through the `math` reward (on the main thread, so its alarm is armed)."""

from __future__ import annotations

import threading

import pytest

from streamrl.rewards.math_answer import equivalent, make_math_answer

pytest.importorskip("math_verify")

EQUIVALENT = [
    ("0.5", r"\frac{1}{2}"),
    (r"\frac{1}{2}", r"The answer is $\boxed{0.5}$"),
    ("0.5", r"so the result is \boxed{\frac{1}{2}}"),
    ("x+1", r"$\boxed{1+x}$"),
    (r"$\sqrt{2}$", r"$\boxed{\sqrt 2}$"),
    ("12", "The answer is 12."),
]
DIFFERENT = [("2", r"$\boxed{3}$"), ("1/3", "0.33"), ("12", "I think 13"), ("1", ""), ("x+1", r"$\boxed{x-1}$")]


@pytest.mark.parametrize(("answer", "completion"), EQUIVALENT)
def test_equivalent_answers_score_one(answer, completion):
    assert equivalent(completion, answer, timeout_s=5)


@pytest.mark.parametrize(("answer", "completion"), DIFFERENT)
def test_different_answers_score_zero(answer, completion):
    assert not equivalent(completion, answer, timeout_s=5)


def test_math_reward_scores_a_batch_and_rejects_a_non_math_answer():
    fn = make_math_answer(5)
    assert fn(
        prompts=["p", "p"],
        completions=[r"\boxed{0.5}", r"\boxed{2}"],
        completion_ids=[[1], [2]],
        answer=[r"\frac12", "3"],
    ) == [1.0, 0.0]
    with pytest.raises(ValueError, match="does not parse as math"):
        fn(prompts=["p"], completions=["1"], completion_ids=[[1]], answer=["no number here"])


def test_math_reward_works_off_the_main_thread_without_the_alarm():
    box = {}
    thread = threading.Thread(target=lambda: box.update(v=make_math_answer(5)(completions=["0.5"], answer=["1/2"])))
    thread.start()
    thread.join(timeout=60)
    assert box["v"] == [1.0]


@pytest.mark.parametrize("answer", ["no number here", "???", ""])
def test_non_math_gold_answers_are_errors_not_zero(answer):
    with pytest.raises(ValueError, match="does not parse as math"):
        equivalent("1", answer, timeout_s=5)
