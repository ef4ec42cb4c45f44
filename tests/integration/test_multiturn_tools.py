"""Tools in real worker processes: results, errors and a hung tool killed at its deadline; the tool
environment end to end through the episode runner (a scripted model makes the tool call)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from streamrl.engine.config import Config, EnvConfig, ModelConfig, RolloutConfig
from streamrl.rollout.backends.protocol import Completion
from streamrl.rollout.envs.episode import build_runner
from streamrl.rollout.envs.tools import ToolPool, ToolPoolError

MY_TOOLS = '''
import time


def slow_echo(text: str, seconds: float = 60.0) -> str:
    """Echo the text after sleeping (a tool that hangs)."""
    time.sleep(seconds)
    return text


def broken(x: int) -> str:
    """Always fails."""
    raise ZeroDivisionError("by design")
'''


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(MY_TOOLS)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a killed child not yet reaped is a zombie
        return f.read().split()[2] != "Z"


def test_tools_answer_fail_and_a_hung_one_is_killed_at_its_deadline(tool_file):
    pool = ToolPool(["calculator", f"{tool_file}:slow_echo", f"{tool_file}:broken"], workers=1, timeout_s=1.0)
    try:
        assert pool.names == ["calculator", "slow_echo", "broken"]
        assert pool.schemas[0]["type"] == "function"
        calc = pool.schemas[0]["function"]
        assert calc["parameters"] == {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        }
        assert calc["description"].startswith("Evaluate an arithmetic expression")

        async def calls():
            assert (await pool.call("calculator", {"expression": "12 * 7"})).text == "84"
            assert (await pool.call("broken", {"x": 1})).text == "error: ZeroDivisionError: by design"
            assert (await pool.call("nope", {})).text.startswith("error: no tool named 'nope'")
            assert (await pool.call("slow_echo", {"text": "hi", "seconds": 0.0})).text == "hi"
            (hung_pid,) = pool.pids
            start = time.monotonic()
            outcome = await pool.call("slow_echo", {"text": "hi"})
            waited = time.monotonic() - start
            assert outcome.timed_out and "did not answer within 1 s (env.tool_timeout_s)" in outcome.error
            assert 1.0 <= waited < 5.0 and not _alive(hung_pid)
            # the replacement serves the next call
            assert (await pool.call("calculator", {"expression": "2 ** 10"})).text == "1024"
            assert pool.pids != [hung_pid]

        asyncio.run(calls())
        assert (pool.calls, pool.timeouts, pool.errors, pool.restarts) == (6, 1, 2, 1)
    finally:
        pool.close()


def test_a_tool_that_cannot_load_fails_the_pool_at_start(tool_file):
    with pytest.raises(ToolPoolError, match="no callable named 'missing'"):
        ToolPool([f"{tool_file}:missing"], workers=1)


class FakeEngine:
    """Stands in for a generation backend. Turn 1: a tool call in the Qwen format; turn 2: the answer."""

    def __init__(self, tokenizer, turns: list[str]):
        self.turns = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
        self.policy_version, self.calls = 0, 0

    async def generate(self, prompt_ids, n, max_tokens):
        ids = self.turns[self.calls]
        self.calls += 1
        return [
            Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop", token_versions=[0] * len(ids))
        ]


def test_the_tool_environment_runs_a_tool_call_end_to_end():
    from streamrl.engine.models import make_tokenizer

    tokenizer = make_tokenizer(seed=0)
    cfg = Config(
        model=ModelConfig(max_model_len=1024),
        rollout=RolloutConfig(max_tokens=64),
        env=EnvConfig(name="tools", tools=["calculator"], tool_timeout_s=5.0),
    )
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
    runner = build_runner(cfg, FakeEngine(tokenizer, [call, "It is 84"]), tokenizer)
    try:
        episode = asyncio.run(runner.run([1], {"prompt": "What is 12 times 7?", "answer": "84"}))
    finally:
        runner.close()
    assert not episode.failure and episode.finish_reason == "done" and episode.turns == 2
    assert episode.reward == 1.0
    assert tokenizer.decode(episode.prompt_ids).endswith("What is 12 times 7?<|im_end|>\n<|im_start|>assistant\n")
    env_ids = [t for t, m in zip(episode.completion_ids, episode.mask) if m == 0]
    # the tiny template has no tool role of its own: it renders the tool message as a `tool` turn
    assert tokenizer.decode(env_ids) == "<|im_end|>\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    model_text = tokenizer.decode([t for t, m in zip(episode.completion_ids, episode.mask) if m == 1])
    assert model_text == call + "It is 84"
    assert episode.tools == {"calls": 1, "failed": 0, "timed_out": 0}


def test_a_short_call_runs_the_tool_on_the_rows_expression_and_its_answer_is_credited_once():
    """examples/calculator.toml's task: "=" calls the calculator on the row's expression; the first result that is
    the answer earns 1.0, and nothing more does (a right final answer after it, another call)."""
    from streamrl.engine.models import make_tokenizer

    tokenizer = make_tokenizer(seed=0)
    args = {"short_call": "=", "reward_tool_answer": True, "system": ""}
    cfg = Config(
        model=ModelConfig(max_model_len=1024),
        rollout=RolloutConfig(max_tokens=64),
        env=EnvConfig(name="tools", tools=["calculator"], args=args, max_turns=3),
    )
    row = {"prompt": "What is 12 times 7?", "answer": "84", "expression": "12 * 7"}
    outcomes = []
    for turns in (
        ["a = b", "= again", "84"],
        ["no call 84"],
        ["no call 85"],
        ['<tool_call>{"name": "x"}</tool_call>'] * 3,
    ):
        runner = build_runner(cfg, FakeEngine(tokenizer, turns), tokenizer)
        try:
            episode = asyncio.run(runner.run([1], row))
        finally:
            runner.close()
        outcomes.append((episode.turns, episode.reward, episode.tools["calls"], episode.tools["failed"]))
        if turns[0] == "a = b":
            env_text = tokenizer.decode([t for t, m in zip(episode.completion_ids, episode.mask) if m == 0])
            assert env_text.count("<|im_start|>tool\n84<|im_end|>") == 2  # the tool's result, in the token stream
    # a short call (1.0, once), a written answer (1.0) or a wrong one, a malformed call (failed; max_turns ends it)
    assert outcomes == [(3, 1.0, 2, 0), (1, 1.0, 0, 0), (1, 0.0, 0, 0), (3, 0.0, 3, 3)]
