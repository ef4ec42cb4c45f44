"""rewards/trial.py against a real reward worker: the run's deadline bounds a slow reward, the opt-out marker is
honoured, a reward that fails on a batch but not alone warns; the batch is the data's first prompts."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from streamrl.engine.config import DataConfig, RewardConfig
from streamrl.rewards.call import Batch
from streamrl.rewards.trial import no_trial, trial, trial_batch, tried

REWARDS = textwrap.dedent("""
    import time

    def slow(completions, **kwargs):
        time.sleep(60)
        return [0.0] * len(completions)

    def judge(completions, **kwargs):
        raise RuntimeError("a remote judge preflight cannot reach")
    judge.streamrl_trial = False

    def batch_only_breaks(completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("cannot score more than one")
        return [1.0]
""")


@pytest.fixture(scope="module")
def rewards(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("trial") / "rw.py"
    path.write_text(REWARDS)
    return str(path)


BATCH = Batch(prompts=["p", "p"], completions=["a", "b"], completion_ids=[[1], [2]], columns={"answer": ["a", "a"]})


def test_a_slow_reward_is_stopped_by_the_runs_deadline(rewards):
    cfg = RewardConfig(functions=[f"{rewards}:slow"], timeout_s=1.0)
    start = time.monotonic()
    found = trial(cfg, BATCH, "data.path = x.jsonl")
    assert time.monotonic() - start < 30  # the worker's start and 1 s: not the reward's 60 s
    assert found == [("error", f"reward '{rewards}:slow' did not return within reward.timeout_s = 1 s on a trial "
                      "call on 2 samples (the first prompts of data.path = x.jsonl, dummy completions); make it "
                      "faster or raise reward.timeout_s; a reward whose trial is not meaningful opts out with "
                      "`fn.streamrl_trial = False`")]  # fmt: skip


def test_a_marked_reward_and_the_reward_model_are_not_tried(rewards):
    cfg = RewardConfig(functions=[f"{rewards}:judge", "reward_model", "demo"])
    assert tried(cfg) == ["demo"]
    assert trial(RewardConfig(functions=[f"{rewards}:judge"]), BATCH) == []  # no worker started for none
    assert no_trial(lambda completions, **kwargs: []).streamrl_trial is False


def test_a_reward_that_breaks_only_on_a_batch_warns(rewards):
    (level, message), = trial(RewardConfig(functions=[f"{rewards}:batch_only_breaks"]), BATCH)  # fmt: skip
    assert level == "warning" and "(ValueError: cannot score more than one) but not on each sample alone" in message


def test_the_trial_batch_is_the_first_prompts_each_with_dummy_completions(tmp_path):
    from streamrl.engine.models import default_tiny_model, load_tokenizer

    rows = [{"prompt": "two plus two", "answer": 4}, {"prompt": "cat", "answer": "c"}, {"prompt": "x", "answer": "y"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(path=str(tmp_path / "d.jsonl"), shuffle=False)
    batch = trial_batch(data, load_tokenizer(str(default_tiny_model())))
    assert batch.prompts == ["two plus two", "two plus two", "cat", "cat"]
    assert batch.completions == ["4", "The answer is 4.", "c", "The answer is 4."]  # the answer, then a guess
    assert batch.columns == {"answer": [4, 4, "c", "c"]} and all(batch.completion_ids)
