"""Environment API pieces: what an environment may return, how one is named, turn-by-turn rendering,
the built-in environments and the calculator tool."""

from __future__ import annotations

import copy
import math

import pytest

from streamrl.rollout.envs.calculator import calculator
from streamrl.rollout.envs.echo import EchoTarget
from streamrl.rollout.envs.protocol import EpisodeFailure, SpecError, load_environment, messages, step_result
from streamrl.rollout.envs.render import TemplateError, TurnRenderer
from streamrl.rollout.envs.tool_env import last_number_matches, parse_tool_calls


@pytest.fixture(scope="module")
def tokenizer():
    from streamrl.engine.models import make_tokenizer

    return make_tokenizer(seed=0)  # the built-in tiny model's tokenizer and chat template


# ---- what an environment returns ----


def test_observations_become_messages():
    assert messages(None, "step") == []
    assert messages("hi", "step") == [{"role": "user", "content": "hi"}]
    tool = [{"role": "tool", "content": "84", "extra": 1}]
    assert messages(tool, "step") == [{"role": "tool", "content": "84"}]


@pytest.mark.parametrize("bad", [42, [{"role": "user"}], [{"role": "user", "content": 3}], {"content": "x"}])
def test_a_malformed_observation_is_env_malformed(bad):
    with pytest.raises(EpisodeFailure) as failure:
        messages(bad, "step")
    assert failure.value.reason == "env_malformed" and "step returned" in failure.value.detail


@pytest.mark.parametrize(
    "bad, says",
    [
        (("obs", 1.0), r"return \(observation, reward, done\)"),
        (("obs", math.nan, False), "finite number"),
        (("obs", True, False), "finite number"),
        (("obs", "1", False), "finite number"),
        (("obs", 1.0, 1), "True or False"),
        ((7, 1.0, False), "an observation is"),
    ],
)
def test_a_malformed_step_result_is_env_malformed(bad, says):
    with pytest.raises(EpisodeFailure, match=says) as failure:
        step_result(bad)
    assert failure.value.reason == "env_malformed"


def test_step_result_accepts_ints_and_lists():
    assert step_result([None, 1, True]) == ([], 1.0, True)


# ---- naming an environment ----


def test_environments_load_by_registered_name_module_and_file(tmp_path):
    assert load_environment("echo_target") is EchoTarget
    assert load_environment("streamrl.rollout.envs.echo:EchoTarget") is EchoTarget
    file = tmp_path / "my_env.py"
    file.write_text(
        "class Env:\n    def reset(self, row):\n        return 'hi'\n    def step(self, text):\n        pass\n"
    )
    assert load_environment(f"{file}:Env").__name__ == "Env"


@pytest.mark.parametrize(
    "spec, says",
    [
        ("nonsense", "not a registered name"),
        ("streamrl.rollout.envs.echo:Missing", "no callable named 'Missing'"),
        ("no_such_module_xyz:Env", "cannot import module"),
        ("/nowhere/env.py:Env", "does not exist"),
        ("streamrl.rollout.envs.calculator:calculator", "has no reset or step method"),
    ],
)
def test_a_bad_environment_name_says_why(spec, says):
    with pytest.raises(SpecError, match=says) as e:
        load_environment(spec)
    assert "env.name" in str(e.value)


# ---- rendering one turn at a time ----

END, START = "<|im_end|>", "<|im_start|>"


def test_an_observation_is_rendered_as_the_template_would_continue(tokenizer):
    render = TurnRenderer(tokenizer)
    ids = render.observation_ids([{"role": "user", "content": "say a"}], last_model_ids=[85])
    expected = f"{END}\n{START}user\nsay a{END}\n{START}assistant\n"
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    # the model closed its turn itself (<|im_end|> sampled): that token is not added twice
    im_end = tokenizer.convert_tokens_to_ids(END)
    assert render.observation_ids([{"role": "user", "content": "say a"}], last_model_ids=[85, im_end]) == ids[1:]
    # no message (the environment only ends the turn): close it and open the model's next one
    assert tokenizer.decode(render.observation_ids([], [85])) == f"{END}\n{START}assistant\n"


def test_a_template_that_changes_past_assistant_turns_still_renders_the_new_turn_only(tokenizer):
    # Qwen3-like: only the last assistant message gets an empty think block, and consecutive tool
    # results share one user turn. Re-rendering the whole conversation would change earlier text.
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (  # turn markers as expressions: HF's Jinja trims a newline after a block tag
        "{% for m in messages %}"
        "{% if m.role == 'assistant' and loop.last %}"
        "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
        "{% elif m.role == 'tool' %}{% if loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
        "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
        "{% if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
        "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    render = TurnRenderer(tok)
    tools = [{"role": "tool", "content": "84"}, {"role": "tool", "content": "7"}]
    text = tok.decode(render.observation_ids(tools, [85]))
    assert text == (
        f"{END}\n{START}user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n7\n</tool_response>"
        f"{END}\n{START}assistant\n"
    )
    # nothing to add: the probe's assistant message is the last one here, and gets the think block
    assert tok.decode(render.observation_ids([], [85])) == f"{END}\n{START}assistant\n"


def test_a_template_that_drops_assistant_content_is_refused_at_start(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    with pytest.raises(TemplateError, match="0 times"):
        TurnRenderer(tok)


def test_without_a_template_the_observation_is_plain_text(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    render = TurnRenderer(tok)
    assert tok.decode(render.observation_ids([{"role": "user", "content": "say a"}], [85])) == "\nsay a\n"
    assert tok.decode(render.first_prompt([{"role": "user", "content": "hi"}])) == "hi"


# ---- built-in environments ----


def test_echo_target_rewards_the_share_of_the_named_letter():
    env = EchoTarget(rounds=2, letters="a")
    assert env.reset({"prompt": "x"}) == "say a"
    # turn 1: "aab" has 2 of 3 letters right, over 2 rounds: 2/3 / 2 = 1/3; not done, names the next
    assert env.step(" aab ") == ("say a", pytest.approx(1 / 3), False)
    # turn 2: "" scores 0 and ends the episode
    assert env.step("") == (None, 0.0, True)


def test_echo_target_letters_follow_the_row():
    one, two = EchoTarget(rounds=4, letters="abcd"), EchoTarget(rounds=4, letters="abcd")
    one.reset({"prompt": "alpha beta"})
    two.reset({"prompt": "alpha beta"})
    assert one.targets == two.targets  # the episodes of a group face the same task


# ---- tools ----


@pytest.mark.parametrize(
    "expression, value", [("12 * (3 + 4)", "84"), ("7 / 2", "3.5"), ("-2 ** 3", "-8"), ("10 // 4 % 3", "2")]
)
def test_calculator(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "x + 1", "9 ** 999", "[1, 2]"])
def test_calculator_refuses_anything_but_arithmetic(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_tool_calls_parse_in_the_qwen_format():
    text = (
        'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    calls = parse_tool_calls(text)
    assert calls[:2] == [("calculator", {"expression": "12*7"}), ("calculator", {"expression": "1+1"})]
    assert calls[2].startswith("the tool call is not JSON") and calls[3].startswith("a tool call is")
    assert parse_tool_calls("the answer is 84") == []


def test_the_final_answer_is_its_last_number():
    assert last_number_matches("12*7 is 84", "84") == 1.0
    assert last_number_matches("84, no: 85", 84) == 0.0
    assert last_number_matches("no number", "84") == 0.0
    assert last_number_matches("84", None) == 0.0
