"""`math`: 1.0 when the completion's final answer is mathematically equivalent to the row's `answer`.

math-verify does the parsing (LaTeX, boxed answers, plain expressions) and the sympy comparison.
Its own timeout uses `signal.alarm`, which works only on a process's main thread: pool workers
call rewards there, so the alarm is armed; inline on another thread it is left off and only the
pool's deadline (reward.timeout_s) can bound a pathological expression.
"""

from __future__ import annotations

import re
import threading

from .builtin import RewardFn


def _timeout(seconds: int) -> int | None:
    return seconds if threading.current_thread() is threading.main_thread() else None


def _looks_like_math(text: str) -> bool:
    # As LaTeX every word parses as a product of symbols ("no" -> n*o): retry only text without
    # words once the LaTeX commands (\\frac, \\sqrt) are taken out.
    bare = re.sub(r"\\[A-Za-z]+", "", text)
    return not text.strip().startswith("$") and re.search(r"[A-Za-z]{2,}", bare) is None


def parse_gold(answer: str, timeout: int | None):
    """The reference answer parsed; a bare expression like `x+1` is retried as inline LaTeX."""
    from math_verify import parse

    text = str(answer)
    gold = parse(text, parsing_timeout=timeout)
    if not gold and _looks_like_math(text):
        gold = parse(f"${text}$", parsing_timeout=timeout)
    if not any(not isinstance(g, str) for g in gold):
        raise ValueError(
            f"math reward: the answer column value {text!r} does not parse as math; fix the "
            "dataset row or use exact_match for non-math answers"
        )
    return gold


def equivalent(completion: str, answer: str, timeout_s: int | None = None) -> bool:
    """Whether the completion's answer (boxed first, else the last expression) equals `answer`."""
    from math_verify import parse, verify

    gold = parse_gold(answer, timeout_s)
    predicted = parse(completion, parsing_timeout=timeout_s)
    return bool(predicted) and bool(verify(gold, predicted, timeout_seconds=timeout_s))


def make_math_answer(timeout_s: int) -> RewardFn:
    if timeout_s < 1:
        raise ValueError(f"reward.math_timeout_s = {timeout_s}; give whole seconds >= 1")
    try:  # now, while a worker boots, so sympy's import (1-2 s) never eats into a call's deadline
        import math_verify  # noqa: F401
    except ImportError:
        raise ValueError("the `math` reward needs math-verify: pip install math-verify") from None

    def math(completions: list[str], answer: list[str], **kwargs) -> list[float]:
        t = _timeout(timeout_s)
        return [float(equivalent(c, a, t)) for c, a in zip(completions, answer, strict=True)]

    return math
