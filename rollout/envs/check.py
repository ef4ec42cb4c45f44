"""What a rollout node resolves from [env] before its first episode, checked without starting anything.

`problems(env, rows)` names, one line each, what the node would fail on: an `env.name` that names no
environment class, an `env.tools` entry that names no callable, `env.args` (and the `toolbox` a tool
pool adds) that the class's constructor cannot take, and, for skyrl-gym, an environment id (the rows'
`env_class` or `env.args.env_id`) that skyrl-gym has not registered. Preflight runs it before any process
starts; the node's `build_runner` runs `bind` on the same class and arguments, so the two agree.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

from streamrl.engine.config.rollout import EnvConfig
from streamrl.rollout.envs.protocol import SpecError, load_environment


def bind(cls: Callable, kwargs: dict) -> None:
    """Raise SpecError when `cls(**kwargs)` cannot be called: a keyword it does not take or one it needs."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read (a C type): the first episode will say
        return
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        given = {k: v for k, v in kwargs.items() if k != "toolbox"}
        takes = ", ".join(p.name for p in signature.parameters.values() if p.name != "toolbox")
        raise SpecError(f"env.args = {given!r} do not fit {getattr(cls, '__name__', cls)}({takes}): {e}") from None


def problems(env: EnvConfig, rows: Callable[[], Iterable[dict]] = tuple) -> list[str]:
    """Why the node could not run `env` (empty when it can); `rows()` reads the prompt rows (for skyrl-gym's
    ids, read only then)."""
    from streamrl.rollout.envs.tool_worker import load_tools

    if not env.name:
        return []
    out: list[str] = []
    try:
        cls = load_environment(env.name)
    except SpecError as e:
        return [str(e)]
    try:
        tools = load_tools(env.tools) if env.tools else {}
    except SpecError as e:
        out.append(str(e))
        tools = {}
    try:
        bind(cls, dict(env.args, **({"toolbox": tools} if env.tools else {})))
    except SpecError as e:
        out.append(str(e))
    from streamrl.rollout.envs.skyrl import SkyRLGymEnv, unregistered

    if cls is SkyRLGymEnv and not out:
        missing = unregistered(env.args.get("env_id") or None, rows())
        out += [missing] if missing else []
    return out
