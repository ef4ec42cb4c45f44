"""Built-in rewards, written as TRL's reward functions are: `fn(completions, answer, **kwargs)`.

They are called by keyword (`prompts=`, `completions=`, `completion_ids=` and every dataset
column as a list, one value per sample, e.g. `answer=[...]`), as TRL's GRPOTrainer calls them. Rewards that
need a setting (a pattern, a target length) are made by a factory from `RewardConfig`, so the
setting is typed config rather than a hidden global.
"""

from __future__ import annotations

import re
from collections.abc import Callable

RewardFn = Callable[..., list]


def _normalize(text: str) -> str:
    return " ".join(str(text).split())


def exact_match(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 where the completion equals the row's `answer` up to whitespace runs and ends, else 0.0."""
    return [float(_normalize(c) == _normalize(a)) for c, a in zip(completions, answer, strict=True)]


def make_regex(pattern: str) -> RewardFn:
    """A format reward: 1.0 where `pattern` matches somewhere in the completion (re.search), else 0.0."""
    if not pattern:
        raise ValueError("reward `regex` needs reward.regex = '<pattern>' (e.g. '<answer>.*</answer>')")
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"reward.regex = {pattern!r} is not a valid regular expression: {e}") from None

    def regex(completions: list[str], **kwargs) -> list[float]:
        return [float(compiled.search(c) is not None) for c in completions]

    return regex


def make_length_penalty(target_tokens: int) -> RewardFn:
    """0 up to `target_tokens` completion tokens, then -1/target per extra token, floored at -1."""
    if target_tokens < 1:
        raise ValueError(f"reward.length_target_tokens = {target_tokens}; give a token count >= 1")

    def length_penalty(completion_ids: list[list[int]], **kwargs) -> list[float]:
        return [-min(1.0, max(0, len(ids) - target_tokens) / target_tokens) for ids in completion_ids]

    return length_penalty
