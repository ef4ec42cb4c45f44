"""rollout/scoring.GroupScorer: groups that finish together are scored in one reward call, each group getting its
own samples' rewards back; a group that cannot be decoded fails alone."""

from __future__ import annotations

import asyncio

import pytest

from streamrl.engine.config import DataConfig
from streamrl.rollout.backends.protocol import Completion
from streamrl.rollout.scoring import GroupScorer
from streamrl.rollout.sources import Prompt

BAD = 999  # a token id FakeTokenizer cannot decode


class FakeTokenizer:
    """Stands in for the model's HF tokenizer: a completion decodes to its ids as text, BAD to an error."""

    def decode(self, ids, skip_special_tokens=True):
        if BAD in ids:
            raise ValueError(f"cannot decode {BAD}")
        return " ".join(map(str, ids))


class FakeScorer:
    """Stands in for rewards/scorer.py `Scorer` (the reward pool): each sample's reward is its prompt's number x 10
    + its completion's first token; records each call's size."""

    def __init__(self):
        self.calls: list[int] = []

    def score(self, prompts, completions, completion_ids, columns):
        self.calls.append(len(completions))
        assert [c["answer"] for c in columns] == [p.split()[-1] for p in prompts]  # rows travel with their prompts
        return [float(c["n"]) * 10 + ids[0] for c, ids in zip(columns, completion_ids)]


def _group(n: int, tokens: list[int]) -> tuple[Prompt, list[Completion]]:
    prompt = Prompt(prompt_ids=[1], row={"prompt": f"p {n}", "answer": str(n), "n": n}, row_number=n)
    return prompt, [
        Completion(token_ids=[t], logprobs=[0.0], finish_reason="length", token_versions=[0]) for t in tokens
    ]


def test_groups_finishing_together_share_a_call_and_each_gets_its_own_rewards():
    scorer = FakeScorer()
    groups = GroupScorer(scorer, FakeTokenizer(), DataConfig())

    async def go():
        return await asyncio.gather(*(groups.score(*_group(n, [n, n + 1, n + 2])) for n in range(12)))

    got = asyncio.run(go())
    assert got == [[n * 10.0 + n, n * 10.0 + n + 1, n * 10.0 + n + 2] for n in range(12)]
    assert scorer.calls == [36] and groups.calls == 1  # all twelve queued before the scoring thread started


def test_a_group_that_cannot_be_decoded_fails_alone_and_a_raising_scorer_fails_its_batch():
    scorer = FakeScorer()
    groups = GroupScorer(scorer, FakeTokenizer(), DataConfig())

    async def go(tokens_of):
        return await asyncio.gather(*(groups.score(*_group(n, tokens_of(n))) for n in range(4)), return_exceptions=True)

    got = asyncio.run(go(lambda n: [BAD] if n == 2 else [n]))
    assert isinstance(got[2], ValueError) and [got[i] for i in (0, 1, 3)] == [[0.0], [11.0], [33.0]]

    scorer.score = lambda *args: (_ for _ in ()).throw(RuntimeError("the reward pool is closed"))
    got = asyncio.run(go(lambda n: [n]))
    assert all(isinstance(g, RuntimeError) for g in got)


def test_a_group_cancelled_while_queued_is_skipped():
    scorer = FakeScorer()
    groups = GroupScorer(scorer, FakeTokenizer(), DataConfig())

    async def go():
        first = asyncio.ensure_future(groups.score(*_group(0, [1])))
        await asyncio.sleep(0)  # the first group's call is under way
        queued = [asyncio.ensure_future(groups.score(*_group(n, [n]))) for n in (1, 2)]
        await asyncio.sleep(0)
        queued[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued[0]
        return await first, await queued[1]

    assert asyncio.run(go()) == ([1.0], [22.0])
    assert scorer.calls == [1, 1]  # the cancelled group's sample never reached the scorer
