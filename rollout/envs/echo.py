"""`echo_target`: the built-in multi-turn demo. The environment names a letter each turn and rewards
the model for repeating it in its next reply.

Turn k's reward is the share of the reply's characters that are the named letter, over `rounds`
turns (so an episode scores 0..1): a smooth signal a random-init tiny model climbs in minutes, and
one it can only climb past 1/len(letters) by reading the environment's last message (the letter
changes between turns), which is what a multi-turn learner has to get right.
"""

from __future__ import annotations

import random
import zlib


class EchoTarget:
    def __init__(self, rounds: int = 2, letters: str = "abcd", prompt_column: str = "prompt"):
        if rounds < 1 or not letters:
            raise ValueError(f"echo_target: rounds = {rounds} and letters = {letters!r}; give rounds >= 1, letters")
        self.rounds, self.letters, self.prompt_column = rounds, letters, prompt_column
        self.targets: list[str] = []

    def reset(self, row: dict) -> str:
        # the row picks the letters, so the episodes of one group (one row) share them
        seed = zlib.crc32(str(row.get(self.prompt_column, row)).encode())
        rng = random.Random(seed)
        self.targets = [rng.choice(self.letters) for _ in range(self.rounds)]
        return self._say()

    def step(self, completion: str) -> tuple[str | None, float, bool]:
        target = self.targets.pop(0)
        text = completion.strip()
        reward = (text.count(target) / len(text) if text else 0.0) / self.rounds
        if not self.targets:
            return None, reward, True
        return self._say(), reward, False

    def _say(self) -> str:
        return f"say {self.targets[0]}"
