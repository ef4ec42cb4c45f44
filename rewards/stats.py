"""Reward statistics of one batch (or one optimizer step), for the metrics, and the flat-step warning.

A group whose rewards are all equal gives every sample a zero group-relative advantage: it costs a
forward/backward pass and teaches nothing. A step made only of such groups is the silent failure
this module makes loud (a reward that always returns the same value, a task too hard or too easy).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence

import msgspec

log = logging.getLogger("streamrl.rewards")

FLAT_TOLERANCE = 1e-8


class RewardStats(msgspec.Struct, kw_only=True):
    """`mean`/`std`/`min`/`max` over non-None rewards (NaN when there are none); std is the population std."""

    samples: int
    mean: float
    std: float
    min: float
    max: float
    none_share: float  # share of samples whose reward is None (dropped as reward_error)
    groups: int  # groups with at least one non-None reward
    zero_variance_groups: int  # of those, groups whose rewards are all equal (zero advantage for every sample)

    @property
    def flat(self) -> bool:
        """No group carries any reward variance: the step has no learning signal."""
        return self.groups > 0 and self.zero_variance_groups == self.groups

    def as_metrics(self, prefix: str = "reward/") -> dict[str, float]:
        return {prefix + f: float(getattr(self, f)) for f in self.__struct_fields__}


def batch_stats(rewards: Sequence[float | None], group_ids: Sequence[str]) -> RewardStats:
    """Statistics of one batch; `group_ids[i]` is sample i's group."""
    if len(rewards) != len(group_ids):
        raise ValueError(f"batch_stats: {len(rewards)} rewards for {len(group_ids)} group ids; give one per sample")
    valid = [r for r in rewards if r is not None]
    by_group: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rewards, group_ids):
        if r is not None:
            by_group[g].append(r)
    n = len(valid)
    mean = sum(valid) / n if n else math.nan
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / n) if n else math.nan
    flat = sum(1 for values in by_group.values() if max(values) - min(values) <= FLAT_TOLERANCE)
    return RewardStats(
        samples=len(rewards),
        mean=mean,
        std=std,
        min=min(valid, default=math.nan),
        max=max(valid, default=math.nan),
        none_share=(len(rewards) - n) / len(rewards) if rewards else 0.0,
        groups=len(by_group),
        zero_variance_groups=flat,
    )


def warn_if_flat(stats: RewardStats, step: int, skipped: bool = False) -> bool:
    """Log a warning when the step has no reward variance in any group; True when it warned. `skipped`: the
    learner took no optimizer update for it (no gradient), which the warning then says."""
    if not stats.flat:
        return False
    outcome = (
        "the step was skipped (no optimizer update; its samples dropped as no_gradient)"
        if skipped
        else "the step learns nothing from its rewards"
    )
    log.warning(
        "step %d: all %d groups have zero reward variance (every reward = %.4g in its group), so every "
        "advantage is 0 and %s. Check that the reward can tell completions apart, raise "
        "rollout.group_size / temperature, or set loss.dynamic_sampling = true (loss.preset = 'dapo') to "
        "replace such groups with new ones",
        step,
        stats.groups,
        stats.mean,
        outcome,
    )
    return True
