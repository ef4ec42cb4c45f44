"""A skyrl-gym environment of your own (a `BaseTextEnv`, as SkyRL's docs write one) and its dataset rows.

The task: a letter is asked for; the reply is scored by the share of its characters that are that letter,
a reward the built-in tiny model can learn within minutes on 2 CPU cores. Each row names this class as
its `env_class` entry point (`letter_env:LetterEnv`, skyrl-gym's `module:Class` form), so it runs without
registering anything; put this folder on PYTHONPATH:

    python examples/skyrl/letter_env.py letters.jsonl
    PYTHONPATH=examples/skyrl streamrl run --data letters.jsonl --steps 30
"""

from __future__ import annotations

import json
import sys

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

LETTERS = "e"  # one letter: learnable by the tiny model in 30 steps (four were not: letter_taskset.py)


class LetterEnv(BaseTextEnv):
    """One turn: the reward is the share of the reply's non-space characters equal to the row's letter."""

    def __init__(self, env_config=None, extras: dict | None = None):
        super().__init__()
        self.letter = (extras or {})["reward_spec"]["ground_truth"]

    def step(self, action: str) -> BaseTextEnvStepOutput:
        chars = [c for c in action if not c.isspace()]
        reward = sum(c == self.letter for c in chars) / len(chars) if chars else 0.0
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})


def rows(n: int = 64) -> list[dict]:
    """SkyRL's dataset rows: a chat `prompt`, the `env_class` entry point, the `reward_spec`."""
    return [
        {
            "data_source": "letters",
            "prompt": [{"role": "user", "content": f"write {LETTERS[i % len(LETTERS)]}"}],
            "env_class": "letter_env:LetterEnv",
            "reward_spec": {"method": "rule", "ground_truth": LETTERS[i % len(LETTERS)]},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "letters.jsonl"
    with open(out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows())
    print(f"{len(rows())} rows written to {out}")
