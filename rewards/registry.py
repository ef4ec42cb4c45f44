"""Resolve a reward spec to a callable: a registry name, `module:function` or `path.py:function`.

The same resolution runs in the caller (to fail early, with the spec named in the error) and
again in every pool worker, which receives only the spec strings and the `RewardConfig`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib
import sys
from collections.abc import Callable

from streamrl.engine.config import RewardConfig

from . import builtin, demo

RewardFn = Callable[..., list]

REWARD_MODEL = "reward_model"  # scored in the caller's process, on its device; see model.py


def _math(cfg: RewardConfig) -> RewardFn:
    from .math_answer import make_math_answer

    return make_math_answer(cfg.math_timeout_s)


BUILTINS: dict[str, Callable[[RewardConfig], RewardFn]] = {
    "demo": lambda cfg: demo.demo,
    "exact_match": lambda cfg: builtin.exact_match,
    "regex": lambda cfg: builtin.make_regex(cfg.regex),
    "length_penalty": lambda cfg: builtin.make_length_penalty(cfg.length_target_tokens),
    "math": _math,
}


class RewardSpecError(ValueError):
    """A reward spec that does not name a callable; the message says which spec and why."""


def _load_file(path: str, spec: str):
    file = pathlib.Path(path).expanduser().resolve()
    if not file.is_file():
        raise RewardSpecError(f"reward {spec!r}: file {file} does not exist")
    name = f"streamrl_user_reward_{abs(hash(str(file)))}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardSpecError(f"reward {spec!r}: importing {file} failed: {type(e).__name__}: {e}") from e
    return module


def _load_module(name: str, spec: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise RewardSpecError(
            f"reward {spec!r}: cannot import module {name!r} ({e}); use a registry name "
            f"({', '.join(BUILTINS)}), `module:function` or `path.py:function`"
        ) from e


def resolve(spec: str, cfg: RewardConfig) -> RewardFn:
    """The reward callable that `spec` names; raises `RewardSpecError` naming the spec."""
    if spec in BUILTINS:
        try:
            return BUILTINS[spec](cfg)
        except ValueError as e:
            raise RewardSpecError(f"reward {spec!r}: {e}") from None
    location, sep, attr = spec.rpartition(":")
    if not sep or not location or not attr:
        raise RewardSpecError(
            f"reward {spec!r} is not a registry name ({', '.join(BUILTINS)}, {REWARD_MODEL}) "
            "nor of the form `module:function` or `path.py:function`"
        )
    module = _load_file(location, spec) if location.endswith(".py") else _load_module(location, spec)
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise RewardSpecError(f"reward {spec!r}: {location} has no callable named {attr!r}")
    _check_signature(fn, spec)
    return fn


def _check_signature(fn: RewardFn, spec: str) -> None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # builtins and C callables: trust them
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 3 and not varargs:
        raise RewardSpecError(
            f"reward {spec!r} takes {len(positional)} positional arguments; a reward is "
            "called as fn(prompts, completions, completion_ids, **columns)"
        )
