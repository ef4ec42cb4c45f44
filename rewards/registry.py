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
from collections.abc import Callable, Iterable

from streamrl.engine.config import RewardConfig

from . import builtin, demo
from .call import CALL_KEYWORDS

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
    check_signature(fn, spec)
    return fn


# TRL passes these too; streamrl does not (a reward that requires one cannot run here).
TRL_ONLY_KEYWORDS = ("trainer_state", "log_extra", "log_metric", "environments")
CONVENTION = (
    "rewards are called by keyword, as TRL's GRPOTrainer calls them: fn(prompts=..., completions=..., "
    "completion_ids=..., **dataset_columns), e.g. `def reward(completions, **kwargs)`"
)


def check_signature(fn: RewardFn, spec: str, columns: Iterable[str] | None = None) -> None:
    """Raise `RewardSpecError` unless `fn` accepts the keywords it will be called with.

    With `columns` (the column keywords the dataset gives, see `call.column_names`), a required
    parameter that no column provides is an error too; without, any required name may be a column.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # builtins and C callables: trust them
    name = getattr(fn, "__qualname__", repr(fn))
    positional_only = [p.name for p in params if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        raise RewardSpecError(
            f"reward {spec!r} ({name}) takes positional-only parameters {positional_only}; {CONVENTION}"
        )
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in params):
        unknown = [k for k in CALL_KEYWORDS if k not in named]
        if unknown:
            raise RewardSpecError(
                f"reward {spec!r} ({name}) does not accept the keyword(s) {unknown}; add **kwargs to its "
                f"parameters. {CONVENTION}"
            )
    if columns is None:
        return
    given = set(CALL_KEYWORDS) | set(columns)
    required = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in given
    ]
    if required:
        trl_only = [r for r in required if r in TRL_ONLY_KEYWORDS]
        hint = f"; {trl_only} are TRL trainer objects streamrl does not pass: give them a default" if trl_only else ""
        if "answer" in required:
            hint += "; data.answer_column names the column passed as `answer`"
        raise RewardSpecError(
            f"reward {spec!r} ({name}) requires {required}, which no dataset column provides (columns: "
            f"{sorted(columns)}){hint}. {CONVENTION}"
        )
