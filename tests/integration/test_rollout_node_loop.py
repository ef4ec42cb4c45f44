"""The node loop with a fake engine (fast): groups, credits, scoring, per-token versions, stop and failures."""

from __future__ import annotations

import asyncio
import re

import pytest

from streamrl.engine.config import Config, DataConfig, RolloutConfig
from streamrl.engine.messages import Trajectory, WeightsReady
from streamrl.rollout.backends.protocol import BackendClock, Completion, GenerationBackend
from streamrl.rollout.node import RolloutNode
from streamrl.rollout.sources import Prompt


def _short(group_id: str) -> str:
    """`n0-1a2b3c-g0` -> `n0-g0`: the middle part is the node process's own (random) incarnation."""
    return re.sub(r"-[0-9a-f]{6}-g", "-g", group_id)


class FakeEngine:
    """Stands in for a generation backend (rollout/backends). Each sample: tokens 10, 11, ... one per
    `step_s`, logprob -0.1 * token index; weights swap in between."""

    def __init__(self, tokens: int = 3, step_s: float = 0.0, fail_on: int | None = None):
        self.policy_version, self.tokens, self.step_s, self.fail_on = 0, tokens, step_s, fail_on
        self.calls = 0
        self.clock = BackendClock()

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int) -> list[Completion]:
        self.calls += 1
        if prompt_ids[0] == self.fail_on:
            raise RuntimeError("engine broke")
        out = [Completion(token_ids=[], logprobs=[], finish_reason="length", token_versions=[]) for _ in range(n)]
        for i in range(min(self.tokens, max_tokens)):
            await asyncio.sleep(self.step_s)
            for c in out:
                c.token_ids.append(10 + i)
                c.logprobs.append(-0.1 * i)
                c.token_versions.append(self.policy_version)
        return out

    async def update_weights(self, ready: WeightsReady) -> float:
        self.policy_version = ready.version
        return 0.0

    async def warm_up(self) -> float:
        return 0.0

    async def close(self) -> None:
        pass


class FakeTokenizer:
    """Stands in for the model's tokenizer: even ids decode to "a", odd ones to "b"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("a" if t % 2 == 0 else "b" for t in ids)


class FakeScorer:
    """Stands in for rewards.Scorer: the share of "a" in each completion."""

    def score(self, prompts, completions, completion_ids, columns):
        assert all(col["answer"] == "a" for col in columns)
        return [c.count("a") / len(c) for c in completions]


class FakeSink:
    """Stands in for the TrajectorySender: keeps what the node sends, numbered."""

    def __init__(self):
        self.sent: list[Trajectory] = []

    def send(self, traj: Trajectory) -> int:
        traj.seq = len(self.sent)
        self.sent.append(traj)
        return traj.seq


class FakeCredits:
    """Stands in for the ledger's admission credits (service.LedgerCredits): grants after `deny_first`
    refusals, records takes and returns."""

    def __init__(self, deny_first: int = 0):
        self.deny_left, self.acquired, self.released = deny_first, [], []

    async def acquire(self, group_id, sample_ids):
        if self.deny_left:
            self.deny_left -= 1
            return False
        self.acquired.append(group_id)
        return True

    async def release(self, group_id, sample_ids, reason):
        self.released.append((group_id, reason))


def _prompts(n: int):
    return [Prompt(prompt_ids=[i + 1, 7], row={"prompt": f"p{i}", "answer": "a"}, row_number=i) for i in range(n)]


def _node(engine, prompts, credits=None, group_size=2, concurrent=2):
    cfg = Config(
        rollout=RolloutConfig(group_size=group_size, max_tokens=3, max_concurrent_groups=concurrent), data=DataConfig()
    )
    sink = FakeSink()
    return RolloutNode(cfg, "n0", engine, prompts, FakeScorer(), sink, FakeTokenizer(), credits), sink


def test_fake_engine_satisfies_the_protocol():
    assert isinstance(FakeEngine(), GenerationBackend)


def test_groups_are_generated_scored_and_sent():
    credits = FakeCredits(deny_first=2)
    node, sink = _node(FakeEngine(), _prompts(3), credits)
    stats = asyncio.run(node.run())
    assert stats.groups_sent == 3 and stats.samples_sent == 6 and stats.tokens_sent == 18
    assert sorted({_short(t.group_id) for t in sink.sent}) == ["n0-g0", "n0-g1", "n0-g2"]
    assert len({t.sample_id for t in sink.sent}) == 6
    t = sink.sent[0]
    assert t.completion_ids == [10, 11, 12] and t.behavior_logprobs == pytest.approx([0.0, -0.1, -0.2])
    assert t.reward == pytest.approx(2 / 3)  # tokens 10, 11, 12 decode to "aba": two a's of three
    assert t.group_size == 2 and t.policy_version == 0 and t.token_versions == []
    assert t.timings.submitted <= t.timings.finished <= t.timings.rewarded
    assert sorted(map(_short, credits.acquired)) == ["n0-g0", "n0-g1", "n0-g2"] and credits.released == []


def test_max_groups_bounds_the_run():
    engine = FakeEngine()
    node, sink = _node(engine, _prompts(10))
    assert asyncio.run(node.run(max_groups=4)).groups_sent == 4
    assert engine.calls == 4 and len(sink.sent) == 8


def test_the_node_fills_its_free_slots_before_any_group_runs():
    """Every free slot is taken in one go (as a client submitting all its requests together): no group's
    request reaches the engine before the others are admitted (vLLM's output handler ran between admissions)."""
    started_when_first_ran = []

    class Recording(FakeEngine):
        async def generate(self, prompt_ids, n, max_tokens):
            if not started_when_first_ran:
                started_when_first_ran.append(node.stats.groups_started)
            return await super().generate(prompt_ids, n, max_tokens)

    node, sink = _node(Recording(), _prompts(12), concurrent=8)
    stats = asyncio.run(node.run())
    assert started_when_first_ran == [8] and stats.groups_sent == 12 and len(sink.sent) == 24


def test_weights_landing_mid_sample_give_per_token_versions():
    engine = FakeEngine(tokens=3, step_s=0.05)
    node, sink = _node(engine, _prompts(1), group_size=1)

    async def scenario():
        run = asyncio.create_task(node.run())
        await asyncio.sleep(0.07)  # after the first token (t=0.05), before the second (t=0.10)
        await node.apply_weights(
            WeightsReady(
                version=5, store_host="h", store_port=1, group_prefix="p", world_size=2, timeout_s=1.0, buckets=[]
            )
        )
        return await run

    stats = asyncio.run(scenario())
    (t,) = sink.sent
    assert t.policy_version == 0 and t.token_versions == [0, 5, 5] and t.min_version == 0
    assert stats.weight_updates == 1 and node.policy_version == 5


def test_failed_group_releases_its_credit_and_others_continue():
    credits = FakeCredits()
    node, sink = _node(FakeEngine(fail_on=2), _prompts(3), credits)
    stats = asyncio.run(node.run())
    assert stats.groups_failed == 1 and stats.groups_sent == 2
    assert [(_short(g), why) for g, why in credits.released] == [("n0-g1", "error: RuntimeError")]
    assert {_short(t.group_id) for t in sink.sent} == {"n0-g0", "n0-g2"}


def test_stop_abandons_groups_past_the_grace_period_and_reports_them():
    credits = FakeCredits()
    node, sink = _node(FakeEngine(tokens=3, step_s=5.0), _prompts(10), credits, concurrent=2)

    async def scenario():
        run = asyncio.create_task(node.run(grace_s=0.1))
        await asyncio.sleep(0.1)
        node.stop("test")
        return await run

    stats = asyncio.run(scenario())
    assert sorted(map(_short, stats.abandoned)) == ["n0-g0", "n0-g1"] and sink.sent == []
    assert sorted((_short(g), why) for g, why in credits.released) == [("n0-g0", "abandoned"), ("n0-g1", "abandoned")]


def test_a_failed_send_stops_the_node_and_raises():
    class DeadSink:
        def send(self, traj):
            raise ConnectionError("learner gone")

    cfg = Config(rollout=RolloutConfig(group_size=2, max_tokens=3, max_concurrent_groups=2))
    node = RolloutNode(cfg, "n0", FakeEngine(), _prompts(50), FakeScorer(), DeadSink(), FakeTokenizer())
    with pytest.raises(ConnectionError, match="learner gone"):
        asyncio.run(node.run())
    assert node.stats.groups_started < 50 and node.stats.samples_sent == 0


def test_abandon_cancels_at_once():
    credits = FakeCredits()
    node, sink = _node(FakeEngine(tokens=3, step_s=5.0), _prompts(10), credits, concurrent=3)

    async def scenario():
        run = asyncio.create_task(node.run(grace_s=60))
        await asyncio.sleep(0.1)
        node.abandon("learner said stop")
        return await asyncio.wait_for(run, 30)

    stats = asyncio.run(scenario())
    assert sorted(map(_short, stats.abandoned)) == ["n0-g0", "n0-g1", "n0-g2"] and sink.sent == []
    assert len(credits.released) == 3 and stats.groups_sent == 0
