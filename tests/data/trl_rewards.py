"""Reward functions written the way TRL's GRPOTrainer docs write them.

("Using a custom reward function", examples 1, 1.1, 3, 5 and 6: the same signatures and calls.)
Tests load them as `path.py:function` specs, inline and in the worker pool.
"""

import asyncio
import re


def reward_func(completions, **kwargs):
    return [float(len(completion)) for completion in completions]


def token_reward_func(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def boxed_reward_func(completions, ground_truth, **kwargs):
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


async def async_reward_func(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [1.0 if completion else 0.0 for completion in completions]


def logging_reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    return [1.0 if gt in c else 0.0 for c, gt in zip(completions, ground_truth)]


SPECS = ["reward_func", "token_reward_func", "boxed_reward_func", "async_reward_func", "logging_reward_func"]
# weights that keep each function's value in its own decimal digits of the combined reward
WEIGHTS = [1.0, 100.0, 1000.0, 10000.0, 100000.0]
COMPLETIONS = ["so \\boxed{2}", "", "\\boxed{5} and 6"]
COMPLETION_IDS = [[1, 2, 3], [], [4, 5]]
ROWS = [{"prompt": "q", "ground_truth": t} for t in ("2", "5", "6")]
# sample 0 "so \boxed{2}": 12 chars + 3 ids * 100 + (boxed 2 == 2) 1000 + non-empty 10000 + "2" in it 100000
# sample 1 "": every function gives 0
# sample 2 "\boxed{5} and 6": 15 chars + 2 ids * 100 + (5 != 6) 0 + non-empty 10000 + "6" in it 100000
EXPECTED = [111312.0, 0.0, 110215.0]
