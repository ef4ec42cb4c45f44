"""The episode runner with a scripted engine (fast): token layout, failures with their reasons, limits,
and the node's group path (failed episodes dropped with their reason, the survivors sent as a group)."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamrl.engine.config import Config, EnvConfig, ModelConfig, RolloutConfig
from streamrl.rollout.backends.protocol import Completion
from streamrl.rollout.envs.echo import EchoTarget
from streamrl.rollout.envs.episode import EpisodeRunner

PROMPT = [7, 8, 9]


@pytest.fixture(scope="module")
def tokenizer():
    from streamrl.engine.models import make_tokenizer

    return make_tokenizer(seed=0)


class FakeEngine:
    """Stands in for a generation backend. Turn k returns `turns[k]` (cut at max_tokens) with logprob
    -(i+1)/10 per token, stamped with its version."""

    def __init__(self, turns: list[list[int]], delay_s: float = 0.0):
        self.turns, self.delay_s, self.policy_version = turns, delay_s, 0
        self.calls: list[tuple[list[int], int]] = []
        self.returned: list[Completion] = []

    async def generate(self, prompt_ids, n, max_tokens):
        assert n == 1
        await asyncio.sleep(self.delay_s)
        ids = self.turns[len(self.calls) % len(self.turns)]
        self.calls.append((list(prompt_ids), max_tokens))
        cut = ids[:max_tokens]
        c = Completion(
            token_ids=cut,
            logprobs=[-(i + 1) / 10 for i in range(len(cut))],
            finish_reason="stop" if len(cut) == len(ids) else "length",
            token_versions=[self.policy_version] * len(cut),
        )
        self.returned.append(c)
        self.policy_version += 1  # a weight update lands after every turn
        return [c]


def _cfg(**env) -> Config:
    env = {"name": "x", **env}
    return Config(model=ModelConfig(max_model_len=512), rollout=RolloutConfig(max_tokens=8), env=EnvConfig(**env))


def _run(runner: EpisodeRunner, row=None):
    return asyncio.run(runner.run(PROMPT, row or {"prompt": "p"}))


def test_three_turns_keep_the_sampled_tokens_and_mask_the_environment(tokenizer):
    aa, ab = tokenizer.encode("aa", add_special_tokens=False), tokenizer.encode("ab", add_special_tokens=False)
    engine = FakeEngine([aa, ab, aa])
    runner = EpisodeRunner(_cfg(max_turns=5), engine, tokenizer, lambda: EchoTarget(rounds=3, letters="a"))
    ep = _run(runner)
    first = tokenizer.encode(
        "<|im_start|>user\nsay a<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )  # reset's "say a", rendered by the chat template
    between = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nsay a<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert ep.prompt_ids == first and not ep.failure and ep.finish_reason == "done" and ep.turns == 3
    assert ep.completion_ids == aa + between + ab + between + aa
    assert ep.mask == [1] * len(aa) + [0] * len(between) + [1] * len(ab) + [0] * len(between) + [1] * len(aa)
    # token in: each turn saw the whole episode so far, exactly
    assert [p for p, _ in engine.calls] == [first, first + aa + between, first + aa + between + ab + between]
    # token out: model spans are the engine's own ids, logprobs and versions; environment spans 0.0 and
    # the version of the model token before them (the engine bumped its version after each turn)
    spans = [(0, aa), (len(aa) + len(between), ab), (2 * len(between) + len(aa) + len(ab), aa)]
    for (start, _), c in zip(spans, engine.returned):
        end = start + len(c.token_ids)
        assert ep.completion_ids[start:end] == c.token_ids
        assert ep.logprobs[start:end] == c.logprobs and ep.versions[start:end] == c.token_versions
    env_positions = [i for i, m in enumerate(ep.mask) if m == 0]
    assert all(ep.logprobs[i] == 0.0 for i in env_positions)
    assert ep.versions == [0] * len(aa) + [0] * len(between) + [1] * len(ab) + [1] * len(between) + [2] * len(aa)
    # rewards: "aa" 1/3, "ab" half of 1/3, "aa" 1/3 -> 1/3 + 1/6 + 1/3 = 5/6
    assert ep.reward == pytest.approx(5 / 6)


class Raising:
    def reset(self, row):
        return None

    def step(self, text):
        raise KeyError("boom")


class Hanging:
    def reset(self, row):
        return None

    def step(self, text):
        time.sleep(3)  # a plain method: abandoned in its thread at the deadline


class HangingAsync:
    async def reset(self, row):
        return None

    async def step(self, text):
        await asyncio.sleep(60)


class Malformed:
    def reset(self, row):
        return None

    def step(self, text):
        return {"not": "an observation"}, 1.0, False


class BrokenConstructor:
    def __init__(self):
        raise RuntimeError("no")


@pytest.mark.parametrize(
    "env, reason, says",
    [
        (Raising, "env_error", "step raised KeyError: 'boom'"),
        (Hanging, "env_timeout", "step did not return within env.step_timeout_s = 0.3 s"),
        (HangingAsync, "env_timeout", "step did not return within env.step_timeout_s = 0.3 s"),
        (Malformed, "env_malformed", "step returned dict"),
        (BrokenConstructor, "env_error", "constructor raised RuntimeError"),
    ],
)
def test_an_environment_failure_ends_the_episode_with_its_reason(tokenizer, env, reason, says):
    runner = EpisodeRunner(_cfg(step_timeout_s=0.3), FakeEngine([[85]]), tokenizer, env)
    start = time.monotonic()
    ep = _run(runner)
    assert time.monotonic() - start < 2.5  # the deadline, not the hang, ends it
    assert ep.failure == reason and says in ep.detail
    assert runner.failures == {reason: 1}


def test_a_slow_episode_passes_its_deadline(tokenizer):
    runner = EpisodeRunner(
        _cfg(episode_timeout_s=0.3, max_turns=100),
        FakeEngine([[85]], delay_s=0.1),
        tokenizer,
        lambda: EchoTarget(rounds=100),
    )
    ep = _run(runner)
    assert ep.failure == "episode_timeout" and "env.episode_timeout_s = 0.3" in ep.detail


def test_limits_end_the_episode_and_are_counted(tokenizer):
    long_turn = [85] * 8
    engine = FakeEngine([long_turn])
    runner = EpisodeRunner(_cfg(max_turns=2, turn_max_tokens=5), engine, tokenizer, lambda: EchoTarget(rounds=9))
    ep = _run(runner)
    assert ep.finish_reason == "max_turns" and ep.turns == 2 and not ep.failure
    assert [budget for _, budget in engine.calls] == [5, 5]  # every turn cut at env.turn_max_tokens
    assert runner.limits == {"max_turns": 1, "turn_max_tokens": 2}
    # a budget of 12 tokens after the prompt: 5 model + 10 environment tokens would not leave room
    runner = EpisodeRunner(_cfg(max_total_tokens=12, turn_max_tokens=5), FakeEngine([long_turn]), tokenizer, EchoTarget)
    ep = _run(runner)
    assert ep.finish_reason == "max_total_tokens" and ep.turns == 1 and ep.mask == [1] * 5


def test_a_first_prompt_with_no_room_is_overlong(tokenizer):
    cfg = _cfg()
    cfg.model.max_model_len = 16
    runner = EpisodeRunner(cfg, FakeEngine([[85]]), tokenizer, lambda: EchoTarget(rounds=1))

    class LongReset(EchoTarget):
        def reset(self, row):
            return "say " + "a " * 40

    runner.env_factory = LongReset
    assert _run(runner).failure == "overlong"


# ---- the node's group path ----

FAIL_SOME = """
import itertools
_made = itertools.count()


class FailSome:
    def __init__(self, fail_every=2):
        self.fail = next(_made) % fail_every == 0

    def reset(self, row):
        return None

    def step(self, text):
        if self.fail:
            raise RuntimeError("an environment bug")
        return None, float(len(text)), True
"""


class FakeSink:
    """Stands in for the TrajectorySender: keeps what the node sends."""

    def __init__(self):
        self.sent = []

    def send(self, traj):
        self.sent.append(traj)
        return len(self.sent) - 1


class FakeCredits:
    """Stands in for the ledger's credits (service.LedgerCredits): grants all, records returns and drops."""

    def __init__(self):
        self.dropped, self.released = [], []

    async def acquire(self, group_id, sample_ids):
        return True

    async def release(self, group_id, sample_ids, reason):
        self.released.append((sample_ids, reason))

    async def drop(self, sample_ids, reason):
        self.dropped.append((sample_ids, reason))


def _node(cfg: Config, tokenizer, engine, rows: list[dict]):
    from streamrl.rollout.node import RolloutNode
    from streamrl.rollout.sources import Prompt

    prompts = [Prompt(prompt_ids=PROMPT, row=row, row_number=i) for i, row in enumerate(rows)]
    sink, credits = FakeSink(), FakeCredits()
    node = RolloutNode(cfg, "n0", engine, prompts, scorer=None, sink=sink, tokenizer=tokenizer, credits=credits)
    return node, sink, credits


def test_failed_episodes_are_dropped_with_their_reason_and_the_rest_sent_as_a_smaller_group(tokenizer, tmp_path):
    (tmp_path / "fail_some.py").write_text(FAIL_SOME)
    cfg = _cfg()
    cfg.env.name = f"{tmp_path / 'fail_some.py'}:FailSome"
    cfg.rollout.group_size = 4
    node, sink, credits = _node(cfg, tokenizer, FakeEngine([[85, 86]]), [{"prompt": "p"}])
    stats = asyncio.run(node.run())
    ((dropped, reason),) = credits.dropped
    assert reason == "env_error" and len(dropped) == 2 and credits.released == []
    assert sorted(dropped + [t.sample_id for t in sink.sent]) == [f"{sink.sent[0].group_id}:{i}" for i in range(4)]
    assert [t.group_size for t in sink.sent] == [2, 2]  # complete at the learner with the survivors
    assert [t.loss_mask for t in sink.sent] == [[], []]  # one turn: every completion token is the model's
    assert [t.reward for t in sink.sent] == [2.0, 2.0]  # len(decode([85, 86])) == 2
    assert stats.episodes_dropped == {"env_error": 2} and stats.groups_sent == 1


def test_a_multi_turn_group_goes_out_with_its_mask_and_versions(tokenizer):
    cfg = _cfg(name="echo_target", args={"rounds": 2, "letters": "a"})
    cfg.rollout.group_size = 2
    node, sink, credits = _node(cfg, tokenizer, FakeEngine([[85]]), [{"prompt": "p"}])
    asyncio.run(node.run())
    assert len(sink.sent) == 2 and credits.dropped == []
    for traj in sink.sent:
        assert traj.loss_mask[0] == 1 and 0 in traj.loss_mask and traj.model_tokens == 2
        assert traj.finish_reason == "done" and traj.group_size == 2
        # the scripted engine bumps its version after every turn: the turns came from different versions
        assert traj.token_versions and traj.min_version == traj.policy_version == traj.token_versions[0]


def test_an_episode_without_a_stamped_token_takes_the_live_version_as_a_completion_does(tokenizer):
    # one definition of a sample's versions (rollout/groups.py stamp) for completions and episodes: an
    # episode whose turn sampled no token is of the engine's live version (the node's two builders
    # differed here: the episode's read ep.versions[0], an IndexError that failed the group)
    cfg = _cfg(name="echo_target", args={"rounds": 1, "letters": "a"})
    cfg.rollout.group_size = 2
    engine = FakeEngine([[]])
    node, sink, credits = _node(cfg, tokenizer, engine, [{"prompt": "p"}])
    stats = asyncio.run(node.run())
    assert stats.groups_failed == 0 and credits.released == [] and len(sink.sent) == 2
    assert [(t.policy_version, t.token_versions, t.completion_ids) for t in sink.sent] == [(2, [], [])] * 2


def test_an_engine_error_fails_the_group_and_cancels_its_other_episodes(tokenizer):
    class OneBreaks:
        policy_version = 0

        def __init__(self):
            self.calls, self.cancelled = 0, 0

        async def generate(self, prompt_ids, n, max_tokens):
            self.calls += 1
            if self.calls == 1:
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            raise RuntimeError("engine broke")

    engine = OneBreaks()
    runner = EpisodeRunner(_cfg(), engine, tokenizer, EchoTarget)

    async def go():
        with pytest.raises(RuntimeError, match="engine broke"):
            await runner.run_group(PROMPT, {"prompt": "p"}, 2)
        await asyncio.sleep(0)  # let the cancellation land

    asyncio.run(asyncio.wait_for(go(), 10))
    assert engine.cancelled == 1 and runner.failures == {}  # not an environment failure
