"""A task whose completion lengths are long and uneven by design: `data.path = "lengths:MIN-MAX[:N[:SEED]]"`.

Reasoning runs produce completions from ~50 to several thousand tokens within one batch, and generation's long
tail is where an asynchronous engine should beat a synchronous one. A random-init model almost never samples its
end-of-sequence token (1 in ~150k at Qwen2's vocabulary), so its lengths would all be `rollout.max_tokens`: here
each row carries its own cap instead, a `max_tokens` column drawn log-uniformly from [MIN, MAX] (seeded), which a
node applies to that prompt's group (`Prompt.cap`). The prompts are the demo's words; pair it with the `copy`
reward (the F1 of the completion's words against the prompt's: graded, and a long completion pays in precision).
"""

from __future__ import annotations

import math
import random

PREFIX = "lengths:"
DEFAULT_ROWS = 2000


def parse(path: str) -> tuple[int, int, int, int]:
    """(low, high, rows, seed) of `lengths:MIN-MAX[:N[:SEED]]`; ValueError naming the fix otherwise."""
    fields = path[len(PREFIX) :].split(":")
    usage = f"data.path = {path!r}: write lengths:MIN-MAX[:ROWS[:SEED]], e.g. 'lengths:48-1024' (token counts)"
    try:
        low_s, high_s = fields[0].split("-")
        low, high = int(low_s), int(high_s)
        rows = int(fields[1]) if len(fields) > 1 else DEFAULT_ROWS
        seed = int(fields[2]) if len(fields) > 2 else 0
    except ValueError:
        raise ValueError(usage) from None
    if len(fields) > 3 or not 1 <= low <= high or rows < 1:
        raise ValueError(f"{usage}; 1 <= MIN <= MAX and ROWS >= 1")
    return low, high, rows, seed


def rows(path: str) -> list[dict]:
    """The task's rows: `{"prompt": <3-8 demo words>, "answer": "a", "max_tokens": <log-uniform in [MIN, MAX]>}`."""
    from streamrl.rewards.demo import demo_rows

    low, high, n, seed = parse(path)
    rng = random.Random(seed + 7919)
    out = demo_rows(n, seed)
    for row in out:
        row["max_tokens"] = round(math.exp(rng.uniform(math.log(low), math.log(high))))
    return out
