"""Calling reward functions safely (inline): per-sample isolation, value checks, async, spec loading."""

from __future__ import annotations

import asyncio
import pathlib
import runpy
import textwrap

import numpy as np
import pytest

from streamrl.engine.config import RewardConfig
from streamrl.rewards import Scorer, build_scorer
from streamrl.rewards.call import Batch, safe_call
from streamrl.rewards.registry import RewardSpecError, check_signature, resolve


def batch(*completions: str) -> Batch:
    n = len(completions)
    return Batch(
        prompts=["p"] * n, completions=list(completions), completion_ids=[[1]] * n, columns={"answer": ["x"] * n}
    )


def picky(prompts, completions, completion_ids, **columns):
    if "bad" in completions:
        raise KeyError("bad sample")
    return [float(len(c)) for c in completions]


def test_a_raising_batch_is_retried_per_sample():
    out = safe_call(picky, batch("ab", "bad", "c"))
    assert out.values == [2.0, None, 1.0] and out.errors == 1 and "KeyError: 'bad sample'" in out.traceback


class FakeBatchReward:
    """Stands in for a user's reward: returns what it is given to return, counting its calls (a retry shows)."""

    def __init__(self, returns):
        self.returns, self.calls = returns, 0

    def __call__(self, completions, **kwargs):
        self.calls += 1
        return self.returns(completions)


def test_a_wrong_length_is_an_error_of_the_reward_never_retried_per_sample():
    # the reward: the batch mean for 3 completions; retried one sample at a time it passed as 3 scores
    mean = FakeBatchReward(lambda completions: [sum(map(len, completions)) / len(completions)])
    out = safe_call(mean, batch("ab", "c", "d"))
    assert out.values == [None, None, None] and out.errors == 3 and not out.fell_back
    assert mean.calls == 1
    last = out.traceback.strip().splitlines()[-1]
    assert last.startswith("streamrl.rewards.call.RewardValueError: reward FakeBatchReward returned 1 values for 3 ")
    assert "one float (or None) per completion" in last and "[score] * len(completions)" in last


def test_a_non_number_fails_the_batch_once_and_a_non_finite_number_only_its_sample():
    text = FakeBatchReward(lambda completions: [1.0, "0.5", 2.0])
    out = safe_call(text, batch("a", "b", "c"))
    assert out.values == [None] * 3 and out.errors == 3 and text.calls == 1
    assert "returned '0.5' (str) for completion 1, not a number" in out.traceback
    nan = FakeBatchReward(lambda completions: [1.0, float("nan"), 2.0])
    out = safe_call(nan, batch("a", "b", "c"))
    assert out.values == [1.0, None, 2.0] and out.errors == 1 and nan.calls == 1
    assert "returned nan for completion 1, not a finite number" in out.traceback


def test_a_batch_that_falls_back_says_so_once(caplog):
    scorer = Scorer(RewardConfig(functions=[f"{__name__}:picky"], workers=0))
    with caplog.at_level("WARNING", logger="streamrl.rewards"):
        assert scorer.score(["p"] * 3, ["ab", "bad", "c"], [[1]] * 3, [{"answer": "x"}] * 3) == [2.0, None, 1.0]
        scorer.score(["p"] * 2, ["bad", "c"], [[1]] * 2, [{"answer": "x"}] * 2)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and caplog.records[0].levelname == "WARNING"
    first = said[0].splitlines()[0]  # the line the live view shows
    assert first.startswith(f"reward '{__name__}:picky' raised on a batch of 3 samples (KeyError: 'bad sample'); ")
    assert "each sample was scored alone, 1 failed (dropped as reward_error)" in first
    assert scorer.stats.errors == 2


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", True, [1.0]])
def test_non_finite_or_non_number_values_are_errors(value):
    out = safe_call(lambda completions, **kwargs: [value] * len(completions), batch("a"))
    assert out.values == [None] and out.errors == 1


def test_numpy_values_and_explicit_none_pass():
    out = safe_call(lambda completions, **kwargs: [np.float32(0.5), np.int64(2)], batch("a", "b"))
    assert out.values == [0.5, 2.0] and out.errors == 0
    out = safe_call(lambda completions, **kwargs: [None, np.float64(1.5)], batch("a", "b"))
    assert out.values == [None, 1.5] and out.errors == 0  # a reward may abstain; that is not an error


async def async_len(prompts, completions, completion_ids, **columns):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def test_async_rewards_run_with_or_without_a_running_loop():
    assert safe_call(async_len, batch("abc")).values == [3.0]

    async def inside_a_loop():
        return safe_call(async_len, batch("ab")).values

    assert asyncio.run(inside_a_loop()) == [2.0]


def test_a_reward_loaded_from_a_file_path(tmp_path):
    path = tmp_path / "rw.py"
    path.write_text(
        textwrap.dedent("""
        def starts_with_answer(prompts, completions, completion_ids, answer, **columns):
            return [float(c.startswith(a)) for c, a in zip(completions, answer)]

        def no_kwargs(prompts, completions):
            return []
    """)
    )
    scorer = Scorer(RewardConfig(functions=[f"{path}:starts_with_answer"], workers=0))
    assert scorer.score(["p", "p"], ["yes!", "no"], [[1], [2]], [{"answer": "yes"}] * 2) == [1.0, 0.0]
    with pytest.raises(RewardSpecError, match=r"no_kwargs\) does not accept the keyword\(s\) \['completion_ids'\]"):
        resolve(f"{path}:no_kwargs", RewardConfig())
    with pytest.raises(RewardSpecError, match="has no callable named 'missing'"):
        resolve(f"{path}:missing", RewardConfig())
    with pytest.raises(RewardSpecError, match="does not exist"):
        resolve(f"{tmp_path}/nope.py:f", RewardConfig())


def test_a_module_function_spec():
    fn = resolve("streamrl.rewards.demo:demo", RewardConfig())
    assert fn(prompts=["p"], completions=["aab"], completion_ids=[[1]], answer=["a"]) == [2 / 3]


def test_inline_scorer_counts_errors_and_none():
    scorer = Scorer(RewardConfig(functions=["exact_match"], workers=0))
    assert scorer.score(["p"], ["x"], [[1]], [{"not_answer": "x"}]) == [None]  # no `answer` column: TypeError
    assert scorer.stats.errors == 1 and scorer.stats.none == 1
    assert scorer.first_error.startswith("exact_match: TypeError")  # what a None reward's trajectory carries
    scorer.score(["p"], ["x"], [[1]], [{"answer": "x"}])
    assert scorer.first_error.startswith("exact_match: TypeError")  # the first, kept


def test_score_async_from_an_event_loop_and_per_function_metrics():
    scorer = Scorer(RewardConfig(functions=["demo", "exact_match"], workers=0))

    async def main():
        return await asyncio.gather(
            scorer.score_async(["p"], ["a"], [[1]], [{"answer": "a"}]),
            scorer.score_async(["p"], ["b"], [[1]], [{"answer": "a"}]),
        )

    assert asyncio.run(main()) == [[2.0], [0.0]]  # "a": demo 1 + exact 1; "b": 0 + 0
    metrics = scorer.stats.as_metrics()
    assert metrics["reward/calls"] == 2.0 and metrics["reward/errors/demo"] == 0.0


def test_a_closed_scorer_refuses_to_score():
    scorer = Scorer(RewardConfig(functions=["demo"], workers=0))
    scorer.close()
    with pytest.raises(RuntimeError, match="closed Scorer"):
        scorer.score(["p"], ["a"], [[1]], [{"answer": "a"}])


TRL_REWARDS = pathlib.Path(__file__).parents[1] / "data" / "trl_rewards.py"


def test_rewards_written_as_trl_documents_them_run_unchanged():
    trl = runpy.run_path(str(TRL_REWARDS))  # the expected values, worked out in the file's comments
    cfg = RewardConfig(functions=[f"{TRL_REWARDS}:{name}" for name in trl["SPECS"]], weights=trl["WEIGHTS"], workers=0)
    with build_scorer(cfg) as scorer:
        n = len(trl["COMPLETIONS"])
        assert scorer.score(["q"] * n, trl["COMPLETIONS"], trl["COMPLETION_IDS"], trl["ROWS"]) == trl["EXPECTED"]
        assert scorer.stats.errors == 0


def test_a_positional_only_reward_is_refused_at_load_naming_it_and_the_convention(tmp_path):
    path = tmp_path / "old.py"
    path.write_text("def by_position(prompts, completions, completion_ids, /):\n    return []\n")
    with pytest.raises(RewardSpecError) as error:
        Scorer(RewardConfig(functions=[f"{path}:by_position"], workers=0))
    message = str(error.value)
    assert "(by_position) takes positional-only parameters ['prompts', 'completions', 'completion_ids']" in message
    assert "called by keyword, as TRL's GRPOTrainer calls them" in message
    assert "def reward(completions, **kwargs)" in message

    def star_args(*args):
        return []

    with pytest.raises(RewardSpecError, match=r"\(.*star_args\) does not accept the keyword"):
        check_signature(star_args, "star_args")


def test_required_parameters_must_be_dataset_columns_when_the_columns_are_known():
    def needs_truth(completions, ground_truth, **kwargs):
        return []

    def positional_names(p, c, i, **kwargs):  # the pre-TRL convention: fine to load, refused against real columns
        return []

    def curriculum(completions, trainer_state, **kwargs):
        return []

    check_signature(needs_truth, "t")  # columns unknown: ground_truth may be one
    check_signature(needs_truth, "t", columns=["ground_truth"])
    with pytest.raises(RewardSpecError, match=r"requires \['ground_truth'\], which no dataset column provides "):
        check_signature(needs_truth, "t", columns=["answer", "question"])
    with pytest.raises(RewardSpecError, match=r"requires \['p', 'c', 'i'\].*columns: \['answer'\]"):
        check_signature(positional_names, "old", columns=["answer"])
    with pytest.raises(RewardSpecError, match=r"\['trainer_state'\] are TRL trainer objects"):
        check_signature(curriculum, "c", columns=[])
