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


class Scripted:
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
    engine = Scripted(tokenizer, ["<answer>no</answer>", f"<answer>{row['answer']}</answer>"])
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
    engine = Scripted(tokenizer, ["I think #### 5", "#### 4"])
    runner = _runner(tokenizer, engine, EnvConfig(name="skyrl_gym"), lambda: cls(env_id="gsm8k_multi_turn"))
    ep = asyncio.run(runner.run([1, 2], row))
    # gsm8k_multi_turn: a well-formed wrong answer earns the format score 0.2 / max_turns = 0.2 / 3,
    # then the right one 1.0 and done
    assert not ep.failure and ep.turns == 2 and ep.reward == pytest.approx(0.2 / 3 + 1.0)
    assert tokenizer.decode(ep.prompt_ids).startswith("<|im_start|>user\nWhat is 2 + 2?")
    assert "tentative numeric answer" in tokenizer.decode(ep.completion_ids)  # its feedback, as a user turn
