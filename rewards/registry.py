"""Resolve a reward spec to a callable: a registry name, `module:function` or `path.py:function`.

The same resolution runs in the caller (to fail early, with the spec named in the error) and
again in every pool worker, which receives only the spec strings and the `RewardConfig`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

from streamrl.engine.config import RewardConfig
from streamrl.engine.user_code import UserCodeError, load_named

from . import builtin, demo
from .call import CALL_KEYWORDS

RewardFn = Callable[..., list]

REWARD_MODEL = "reward_model"  # scored in the caller's process, on its device; see model.py


def _math(cfg: RewardConfig) -> RewardFn:
    from .math_answer import make_math_answer

    return make_math_answer(cfg.math_timeout_s)


BUILTINS: dict[str, Callable[[RewardConfig], RewardFn]] = {
    "demo": lambda cfg: demo.demo,
    "copy": lambda cfg: demo.copy_words,
    "exact_match": lambda cfg: builtin.exact_match,
    "regex": lambda cfg: builtin.make_regex(cfg.regex),
    "length_penalty": lambda cfg: builtin.make_length_penalty(cfg.length_target_tokens),
    "math": _math,
}


class RewardSpecError(ValueError):
    """A reward spec that does not name a callable; the message says which spec and why."""


def resolve(spec: str, cfg: RewardConfig) -> RewardFn:
    """The reward callable that `spec` names; raises `RewardSpecError` naming the spec."""
    if spec in BUILTINS:
        try:
            return BUILTINS[spec](cfg)
        except ValueError as e:
            raise RewardSpecError(f"reward {spec!r}: {e}") from None
    names = f"a registry name ({', '.join(BUILTINS)}, {REWARD_MODEL})"
    try:
        fn = load_named(spec, "reward", forms=f"{names} nor of the form `module:function` or `path.py:function`")
    except UserCodeError as e:
        hint = f"; use {names}, `module:function` or `path.py:function`" if "cannot import" in str(e) else ""
        raise RewardSpecError(str(e).replace(" is not of the form", " is not") + hint) from e.__cause__
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
