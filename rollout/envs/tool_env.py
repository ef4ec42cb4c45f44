"""`tools`: a tool-calling environment. The model calls tools in its chat template's own format, the
node runs them in worker processes (tools.py) and the results come back as `tool` messages.

Tool calls are the Qwen family's (Hermes style), which its chat templates render and teach:
`<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>`, any number
per turn. A turn without a tool call is the final answer, scored against the row's answer column
(1.0 when its last number equals the answer, else 0.0), and ends the episode. A call that is not
valid JSON, names an unknown tool, raises or misses its deadline is answered with an error the
model reads; it is the model's mistake to learn from, not an environment failure.

For a model too small to write a JSON call (the built-in tiny model, examples/calculator.toml),
`short_call` names a marker (e.g. "="): a turn that holds it and no full call calls the first tool on
the row's `expression_column`, and `reward_tool_answer` credits 1.0 the first time a tool's result is
the answer, so that calling the tool is the way to the reward (an episode's reward stays at most 1.0).
"""

from __future__ import annotations

import json
import re

from streamrl.rollout.envs.tools import ToolPool

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
SYSTEM = (
    "Answer the user's question. To use a tool, write "
    '<tool_call>{"name": TOOL, "arguments": {...}}</tool_call> and wait for its result. '
    "End with the final answer as a number, without a tool call."
)


def parse_tool_calls(text: str) -> list[tuple[str, dict] | str]:
    """Each tool call in `text`: (name, arguments), or an error string saying what is wrong with it."""
    calls: list[tuple[str, dict] | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"the tool call is not JSON ({e.msg} at {e.pos}): {body[:100]}")
            continue
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some templates and models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            calls.append('a tool call is {"name": str, "arguments": {...}}; got ' + body[:100])
            continue
        calls.append((call["name"], arguments))
    return calls


def last_number_matches(text: str, answer) -> float:
    """1.0 when the last number in `text` equals `answer` (as numbers), else 0.0."""
    numbers = NUMBER.findall(text)
    try:
        return float(bool(numbers) and abs(float(numbers[-1]) - float(answer)) < 1e-9)
    except (TypeError, ValueError):
        return 0.0


class ToolEnv:
    def __init__(
        self,
        toolbox: ToolPool | None = None,
        system: str = SYSTEM,
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        max_calls_per_turn: int = 4,
        short_call: str = "",
        expression_column: str = "expression",
        reward_tool_answer: bool = False,
    ):
        if toolbox is None:
            raise ValueError("the tools environment runs tools: set env.tools (e.g. ['calculator'])")
        self.toolbox, self.system = toolbox, system
        self.prompt_column, self.answer_column = prompt_column, answer_column
        self.max_calls_per_turn = max_calls_per_turn
        self.short_call, self.expression_column = short_call, expression_column
        self.reward_tool_answer, self.credited = reward_tool_answer, False
        self.tools = toolbox.schemas  # for the chat template (Qwen renders them into its system prompt)
        self.answer = None
        self.tool_counts = {"calls": 0, "failed": 0, "timed_out": 0}  # this episode's, read by the runner

    def reset(self, row: dict) -> list[dict]:
        question = row.get(self.prompt_column)
        if not isinstance(question, str) or not question:
            raise ValueError(f"row has no question in column {self.prompt_column!r} (columns: {sorted(row)})")
        self.answer = row.get(self.answer_column)
        self.expression = row.get(self.expression_column)
        if self.short_call and not isinstance(self.expression, str):
            raise ValueError(f"short_call needs the row's expression in column {self.expression_column!r}")
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": question}]

    async def step(self, completion: str) -> tuple[list[dict] | None, float, bool]:
        calls = parse_tool_calls(completion)
        if not calls and self.short_call and self.short_call in completion:
            calls = [(self.toolbox.names[0], {"expression": self.expression})]
        if not calls:
            return None, 0.0 if self.credited else last_number_matches(completion, self.answer), True
        results, reward = [], 0.0
        for call in calls[: self.max_calls_per_turn]:
            self.tool_counts["calls"] += 1
            if isinstance(call, str):
                self.tool_counts["failed"] += 1
                results.append(f"error: {call}")
                continue
            outcome = await self.toolbox.call(*call)
            self.tool_counts["timed_out" if outcome.timed_out else "failed"] += bool(outcome.error)
            results.append(outcome.text)
            if self.reward_tool_answer and not self.credited and not outcome.error:
                self.credited = reward = last_number_matches(outcome.output, self.answer) == 1.0
        if len(calls) > self.max_calls_per_turn:
            results.append(f"error: at most {self.max_calls_per_turn} tool calls per turn; the rest were not run")
        return [{"role": "tool", "content": r} for r in results], float(reward), False
