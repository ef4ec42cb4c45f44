"""The built-in demo task: prompts of words, and a reward for answering with one letter.

A random-init tiny model emits a roughly uniform mix of its byte-level tokens, so the share of
`a` characters starts near a few percent and climbs within minutes of RL on 2 CPUs: a reward
with a smooth signal (a share, not a 0/1 match) is what makes that learning visible.
"""

from __future__ import annotations

import random

from streamrl.engine.models import WORDS

# the tiny model's own words (its tokenizer was trained on them), without the filler ones
DEMO_WORDS = WORDS[: WORDS.index("the")]


def demo_rows(n: int, seed: int = 0) -> list[dict]:
    """`n` seeded rows `{"prompt": <3-8 words>, "answer": "a"}` of the built-in demo dataset."""
    if n < 0:
        raise ValueError(f"demo_rows: n = {n}; give a count >= 0")
    rng = random.Random(seed)
    return [
        {"prompt": " ".join(rng.choice(DEMO_WORDS) for _ in range(rng.randint(3, 8))), "answer": "a"} for _ in range(n)
    ]


def letter_share(completion: str, letter: str) -> float:
    """Share of the completion's non-whitespace characters equal to `letter`; 0.0 when there are none."""
    chars = [c for c in completion if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c == letter for c in chars) / len(chars)


def demo(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """The demo task's reward: per sample, the share of characters equal to that row's `answer` letter."""
    return [letter_share(completion, letter) for completion, letter in zip(completions, answer, strict=True)]
