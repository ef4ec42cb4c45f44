"""Rewards: TRL-style reward functions, a reward-model scorer, and safe execution in a worker pool.

    scorer = build_scorer(cfg.reward)
    rewards = scorer.score(prompts, completions, completion_ids, columns=[{"answer": "a"}, ...])
    scorer.stats.as_metrics(); scorer.close()

`columns[i]` is sample i's dataset row. Reward functions are called as TRL calls them, by keyword:
`fn(prompts=[...], completions=[...], completion_ids=[...], answer=[...], ...)`, one list per dataset
column, so `def reward(completions, **kwargs)` works. Built-in rewards read the `answer` column.
"""

from .call import Batch
from .demo import demo_rows, letter_share
from .registry import BUILTINS, REWARD_MODEL, RewardSpecError, resolve
from .scorer import Scorer, ScorerStats, build_scorer, combine
from .stats import RewardStats, batch_stats, warn_if_flat
from .trial import no_trial

__all__ = [
    "BUILTINS",
    "REWARD_MODEL",
    "Batch",
    "RewardSpecError",
    "RewardStats",
    "Scorer",
    "ScorerStats",
    "batch_stats",
    "build_scorer",
    "combine",
    "demo_rows",
    "letter_share",
    "no_trial",
    "resolve",
    "warn_if_flat",
]
