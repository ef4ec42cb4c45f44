"""The environment API, and how an environment is named in config.

An environment is a class; the rollout node makes one instance per episode (`env.args` are its
keyword arguments) and calls, each as a plain or an `async` method:

    reset(row: dict) -> Observation | None          # the episode's first prompt; None: the row's own prompt
    step(completion: str) -> (Observation | None, reward: float, done: bool)
    close() -> None                                  # optional; called once the episode ends, whatever happened

`completion` is the model's turn decoded without special tokens. An `Observation` is what the
environment says next: a string (one user message) or a list of chat messages
(`{"role": ..., "content": str}`, e.g. `{"role": "tool", ...}` for tool results); None or an empty
list ends the model's turn with nothing added. The node renders it with the tokenizer's chat
template and appends its token ids to the episode (rollout/envs/render.py). The episode's reward
is the sum of the step rewards. An optional `tools` attribute (a list of JSON schemas) is passed
to the chat template of the first prompt, as `apply_chat_template(..., tools=...)` expects; an optional
`tool_counts` dict (`calls`, `failed`, `timed_out`) is read when the episode ends and reaches the step's
metrics (`env/tool_calls`, ...).

Plain methods run in a thread of their own, so a hung one cannot stop the node (it is abandoned at
its deadline); `async` methods run on the node's event loop and must not block it.

Names, like reward functions: a registered name (`BUILTINS`), `module:Class` or `path.py:Class`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from streamrl.engine.user_code import UserCodeError, load_named

Message = dict[str, str]
Observation = str | list[Message] | None

BUILTINS: dict[str, str] = {
    "echo_target": "streamrl.rollout.envs.echo:EchoTarget",
    "tools": "streamrl.rollout.envs.tool_env:ToolEnv",
    "reasoning_gym": "streamrl.rollout.envs.reasoning_gym:ReasoningGymEnv",
    "skyrl_gym": "streamrl.rollout.envs.skyrl:SkyRLGymEnv",
}


class Environment(Protocol):
    def reset(self, row: dict) -> Observation | Awaitable[Observation]: ...

    def step(self, completion: str) -> tuple[Observation, float, bool] | Awaitable[tuple[Observation, float, bool]]: ...


class SpecError(ValueError):
    """A name in config that does not name a usable class or callable; the message says which and why."""


class EpisodeFailure(Exception):
    """Ends an episode as dropped:<reason> in the ledger (env_error, env_timeout, env_malformed, ...)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def load_object(spec: str, field: str, builtins: dict[str, str]) -> Any:
    """The object `spec` names: a key of `builtins`, `module:name` or `path.py:name` (as reward.functions)."""
    forms = f"a registered name ({', '.join(builtins) or 'none'}) nor of the form `module:name` or `path.py:name`"
    try:
        return load_named(builtins.get(spec, spec), f"{field} =", forms=forms)
    except UserCodeError as e:
        raise SpecError(str(e).replace(" is not of the form", " is not")) from e.__cause__


def load_environment(spec: str) -> Callable[..., Environment]:
    """The environment class `env.name` names; it must have `reset` and `step`."""
    cls = load_object(spec, "env.name", BUILTINS)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise SpecError(f"env.name = {spec!r}: {cls.__name__} has no {' or '.join(missing)} method")
    return cls


# ---- what an environment returns, checked (a bad value ends the episode as env_malformed) ----


def messages(observation: Any, where: str) -> list[Message]:
    """An observation as chat messages; anything else is an `env_malformed` failure."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    ok = isinstance(observation, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in observation
    )
    if not ok:
        raise EpisodeFailure(
            "env_malformed",
            f"{where} returned {_show(observation)}; an observation is a str, a list of "
            "{'role': str, 'content': str} messages, or None",
        )
    return [{"role": m["role"], "content": m["content"]} for m in observation]


def step_result(result: Any) -> tuple[list[Message], float, bool]:
    """`step`'s (observation, reward, done), checked."""
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise EpisodeFailure("env_malformed", f"step returned {_show(result)}; return (observation, reward, done)")
    observation, reward, done = result
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EpisodeFailure("env_malformed", f"step returned reward {_show(reward)}; give a finite number")
    if not isinstance(done, bool):
        raise EpisodeFailure("env_malformed", f"step returned done {_show(done)}; give True or False")
    return messages(observation, "step"), float(reward), done


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"
