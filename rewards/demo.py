"""The built-in demo tasks: prompts of words, and a reward for answering with one letter (`demo`) or with the
prompt's words (`copy`).

A random-init tiny model emits a roughly uniform mix of its byte-level tokens, so the share of
`a` characters starts near a few percent and climbs within minutes of RL on 2 CPUs: a reward
with a smooth signal (a share, not a 0/1 match) is what makes that learning visible. It also saturates: a
model that writes only `a` has every group's reward at 1.0 and nothing left to learn (on one GPU, the 0.5B
shape at examples/gpu.toml's settings did by step 5). `copy` has no such shortcut: the reward is the F1 of the
completion's words against the prompt's, so it grows by writing the task's words (precision), then the
prompt's own (it must read the prompt), then all of them and no more (recall, and stopping); on 2 CPUs the
tiny model went 0.02 -> 0.15-0.25 over 60 steps, still rising, no step without a gradient.
"""

from __future__ import annotations

import random
from collections import Counter

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


def word_f1(completion: str, prompt: str) -> float:
    """F1 of the completion's words (whitespace-split, with repeats) against the prompt's; 0.0 when none match."""
    said, asked = completion.split(), prompt.split()
    matched = sum((Counter(said) & Counter(asked)).values())
    if not matched:
        return 0.0
    precision, recall = matched / len(said), matched / len(asked)
    return 2 * precision * recall / (precision + recall)


def copy_words(completions: list[str], prompts: list[str], **kwargs) -> list[float]:
    """The copy task's reward: per sample, `word_f1` of the completion against its prompt."""
    return [word_f1(completion, prompt) for completion, prompt in zip(completions, prompts, strict=True)]
