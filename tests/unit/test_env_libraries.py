"""Libraries users already have: reasoning-gym tasks as rows with their own scoring, and skyrl-gym
environments through the adapter (both offline, pure Python)."""

from __future__ import annotations

import asyncio
import json

import pytest

from streamrl.engine.config import Config, DataConfig, EnvConfig, ModelConfig, RewardConfig, RolloutConfig
from streamrl.rollout.backends.protocol import Completion
from streamrl.rollout.envs.episode import EpisodeRunner


@pytest.fixture(scope="module")
def tokenizer():
    from streamrl.engine.models import make_tokenizer

    return make_tokenizer(seed=0)


def test_reasoning_gym_rows_score_their_own_answers():
    pytest.importorskip("reasoning_gym")
    from streamrl.rewards.registry import resolve
    from streamrl.rollout.envs import reasoning_gym as rg

    rows = json.loads(json.dumps(rg.rows("reasoning_gym:basic_arithmetic:4:1")))  # as they travel in jsonl
    assert len(rows) == 4 and rows[0]["rg_task"] == ["basic_arithmetic", 4, 1, 0]
    assert rows[0]["messages"][1] == {"role": "user", "content": rows[0]["prompt"]}
    assert "<answer>" in rows[0]["messages"][0]["content"]
    reward = resolve("streamrl.rollout.envs.reasoning_gym:score", RewardConfig())  # as reward.functions names it
    right = [f"so <answer>{r['answer']}</answer>" for r in rows]
    wrong = ["<answer>not a number</answer>", rows[0]["answer"], "", "<answer></answer>"]  # no tags: 0
    columns = {k: [r[k] for r in rows] for k in rows[0]}
    assert reward([""] * 4, right, [[]] * 4, **columns) == [1.0] * 4
    assert reward([""] * 4, wrong, [[]] * 4, **columns) == [0.0] * 4


def test_reasoning_gym_rows_are_a_prompt_file(tmp_path, tokenizer):
    pytest.importorskip("reasoning_gym")
    from typer.testing import CliRunner

    from streamrl.cli import app
    from streamrl.rollout.sources import PromptSource

    out = tmp_path / "rows.jsonl"
    result = CliRunner().invoke(app, ["reasoning-gym", "basic_arithmetic", "--size", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    prompts = list(PromptSource(DataConfig(path=str(out), loop=False, max_prompt_tokens=4096), tokenizer))
    assert len(prompts) == 3 and all(p.row["rg_task"][0] == "basic_arithmetic" for p in prompts)


@pytest.mark.parametrize(
    "spec, says",
    [("reasoning_gym:", "write reasoning_gym:NAME"), ("reasoning_gym:x:y", "whole numbers"), ("other:x", "write")],
)
def test_a_bad_reasoning_gym_spec_says_how_to_write_one(spec, says):
    from streamrl.rollout.envs.reasoning_gym import parse_spec

    with pytest.raises(ValueError, match=says):
        parse_spec(spec)


class FakeEngine:
    """Stands in for a generation backend: turn k answers `turns[k]`, tokenized."""

    def __init__(self, tokenizer, turns: list[str]):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.policy_version = 0

    async def generate(self, prompt_ids, n, max_tokens):
        ids = self.turns.pop(0)
        return [
            Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop", token_versions=[0] * len(ids))
        ]


def _runner(tokenizer, engine, env: EnvConfig, factory) -> EpisodeRunner:
    cfg = Config(model=ModelConfig(max_model_len=1024), rollout=RolloutConfig(max_tokens=32), env=env)
    return EpisodeRunner(cfg, engine, tokenizer, factory)


def test_reasoning_gym_environment_gives_a_second_attempt(tokenizer):
    pytest.importorskip("reasoning_gym")
    from streamrl.rollout.envs.reasoning_gym import ReasoningGymEnv, rows

    (row,) = rows("reasoning_gym:basic_arithmetic:1:3")
    engine = FakeEngine(tokenizer, ["<answer>no</answer>", f"<answer>{row['answer']}</answer>"])
    runner = _runner(tokenizer, engine, EnvConfig(name="reasoning_gym"), lambda: ReasoningGymEnv(attempts=2))
    ep = asyncio.run(runner.run([1, 2], row))
    assert ep.turns == 2 and ep.reward == 1.0 and ep.finish_reason == "done"
    assert "That is not correct. Try again." in tokenizer.decode(ep.completion_ids)


def test_a_skyrl_gym_environment_runs_through_the_adapter(tokenizer):
    pytest.importorskip("skyrl_gym")
    from streamrl.rollout.envs.protocol import load_environment

    row = {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "reward_spec": {"method": "rule", "ground_truth": "4"},
        "extra_info": {"max_turns": 3},
    }
    cls = load_environment("skyrl_gym")
    engine = FakeEngine(tokenizer, ["I think #### 5", "#### 4"])
    runner = _runner(tokenizer, engine, EnvConfig(name="skyrl_gym"), lambda: cls(env_id="gsm8k_multi_turn"))
    ep = asyncio.run(runner.run([1, 2], row))
    # gsm8k_multi_turn: a well-formed wrong answer earns the format score 0.2 / max_turns = 0.2 / 3,
    # then the right one 1.0 and done
    assert not ep.failure and ep.turns == 2 and ep.reward == pytest.approx(0.2 / 3 + 1.0)
    assert tokenizer.decode(ep.prompt_ids).startswith("<|im_start|>user\nWhat is 2 + 2?")
    assert "tentative numeric answer" in tokenizer.decode(ep.completion_ids)  # its feedback, as a user turn


def test_a_skyrl_row_names_its_own_environment(tokenizer):
    pytest.importorskip("skyrl_gym")
    from streamrl.rollout.envs.skyrl import SkyRLGymEnv

    row = {
        "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
        "env_class": "gsm8k",
        "reward_spec": {"method": "rule", "ground_truth": "4"},
    }
    engine = FakeEngine(tokenizer, ["#### 4"])
    runner = _runner(tokenizer, engine, EnvConfig(name="skyrl_gym"), SkyRLGymEnv)  # no env.args
    ep = asyncio.run(runner.run([1, 2], row))
    assert not ep.failure and ep.turns == 1 and ep.reward == 1.0  # gsm8k: one step, done
    ep = asyncio.run(runner.run([1, 2], {"prompt": row["prompt"]}))
    assert ep.failure == "env_error" and "the row has no env_class" in ep.detail


# ---- what a source implies (rollout/envs/libraries.py) ----


def _implied(data: dict, tiny_model: str) -> tuple[list[str], str]:
    from streamrl.engine.config import build
    from streamrl.rollout.envs.libraries import implied

    data = {**data, "model": {"path": tiny_model, **data.get("model", {})}}
    return implied(data, build(data))


def test_a_reasoning_gym_source_brings_its_scorer_and_prompt_length(tiny_model):
    pytest.importorskip("reasoning_gym")
    from streamrl.engine.config import build

    extra, said = _implied({"data": {"path": "reasoning_gym:basic_arithmetic:8"}}, tiny_model)
    assert extra[0] == 'reward.functions=["streamrl.rollout.envs.reasoning_gym:score"]'
    (length,) = [int(e.split("=")[1]) for e in extra if e.startswith("data.max_prompt_tokens=")]
    assert 256 < length < 512 and "is a reasoning_gym source" in said  # ~430 tokens with the tiny tokenizer
    cfg = build({"data": {"path": "reasoning_gym:basic_arithmetic:8"}}, extra)
    assert cfg.reward.functions == ["streamrl.rollout.envs.reasoning_gym:score"]
    # an explicit setting wins
    path = "reasoning_gym:basic_arithmetic:8"
    given = {"data": {"path": path, "max_prompt_tokens": 300}, "reward": {"functions": ["x:y"]}}
    assert _implied(given, tiny_model) == ([], "")
    # a prompt and a completion past model.max_model_len = 512 (the default) make room for both
    extra, _ = _implied({"data": {"path": path}, "rollout": {"max_tokens": 200}}, tiny_model)
    assert f"model.max_model_len={length + 200}" in extra
    given = {"data": {"path": path}, "rollout": {"max_tokens": 200}, "model": {"max_model_len": 512}}
    assert not [e for e in _implied(given, tiny_model)[0] if e.startswith("model.")]


def test_skyrl_rows_bring_the_environment_and_a_plain_file_nothing(tmp_path, tiny_model):
    row = {"prompt": [{"role": "user", "content": "2 + 2?"}], "env_class": "gsm8k", "reward_spec": {}}
    (tmp_path / "sky.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"prompt": "2 + 2?", "answer": "4"}) + "\n")
    extra, said = _implied({"data": {"path": str(tmp_path / "sky.jsonl")}}, tiny_model)
    assert extra == ['env.name="skyrl_gym"', 'data.messages_column="prompt"'] and "is a skyrl_gym source" in said
    assert _implied({"data": {"path": str(tmp_path / "plain.jsonl")}}, tiny_model) == ([], "")
    assert _implied({"data": {"path": str(tmp_path / "missing.jsonl")}}, tiny_model) == ([], "")


# ---- verifiers tasksets (rollout/envs/verifiers_tasks.py) ----

TASKSETS = """
import verifiers.v1 as vf


class Data(vf.TaskData):
    target: str = ""


class Exact(vf.Task[Data, vf.State, vf.TaskConfig]):
    @vf.reward(weight=2.0)
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.target)

    @vf.reward(weight=0.5)
    async def short(self, task, trace) -> float:
        return float(len(trace.last_reply) < 4)


class Boxed(Exact):
    NEEDS_CONTAINER = True


class Sandboxed(Exact):
    @vf.reward
    async def reads_a_file(self, task, trace, runtime) -> float:
        return 1.0


class {name}(vf.Taskset[{task}, vf.TasksetConfig]):
    def load(self):
        for word in ("cat", "dog"):
            yield {task}(Data(prompt=[vf.UserMessage(content=f"say {{word}}")], system_prompt="Be brief.", target=word))


__all__ = ["{name}"]
"""


@pytest.fixture
def vf_tasksets(tmp_path, monkeypatch):
    pytest.importorskip("verifiers.v1")
    for module, task in [("vf_exact", "Exact"), ("vf_boxed", "Boxed"), ("vf_sandboxed", "Sandboxed")]:
        (tmp_path / f"{module}.py").write_text(TASKSETS.format(name=f"{task}Set", task=task))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_verifiers_taskset_is_rows_scored_by_its_rewards(vf_tasksets):
    from streamrl.rewards.registry import resolve
    from streamrl.rollout.envs import verifiers_tasks as vt

    rows = json.loads(json.dumps(vt.rows("verifiers:vf_exact")))  # as they travel
    assert rows[1] == {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "say dog"}],
        "prompt": "say dog",
        "vf_task": ["vf_exact", 1],
    }
    reward = resolve("streamrl.rollout.envs.verifiers_tasks:score", RewardConfig())
    columns = {"vf_task": [r["vf_task"] for r in rows]}
    # verifiers' weighted sum: exact (weight 2) + short (weight 0.5)
    assert reward(["", ""], ["cat", "a dog"], [[], []], **columns) == [2.0 + 0.5, 0.0]


@pytest.mark.parametrize(
    "module, why",
    [
        ("vf_boxed", "it needs a container (NEEDS_CONTAINER or an image), which streamrl does not provide"),
        ("vf_sandboxed", "its rewards ['reads_a_file'] read the sandbox (a runtime), which streamrl does not provide"),
    ],
)
def test_a_verifiers_taskset_that_needs_a_sandbox_is_refused_in_one_line(vf_tasksets, tokenizer, module, why):
    from streamrl.rollout.sources import PromptSourceError, scan

    with pytest.raises(PromptSourceError) as e:
        scan(DataConfig(path=f"verifiers:{module}"), tokenizer)
    assert str(e.value) == f"data.path = 'verifiers:{module}' cannot run here: {why}"
