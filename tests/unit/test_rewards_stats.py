"""Per-batch reward statistics against hand-worked numbers; the flat-step warning."""

from __future__ import annotations

import logging
import math

import pytest

from streamrl.rewards.stats import batch_stats, warn_if_flat


def test_stats_skip_none_and_count_flat_groups():
    rewards = [1.0, 0.0, None, 0.5, 0.5, None]
    groups = ["g1", "g1", "g1", "g2", "g2", "g3"]
    s = batch_stats(rewards, groups)
    # valid: 1, 0, 0.5, 0.5 -> mean 0.5; squared deviations .25 .25 0 0 -> var 0.125 -> std 0.353553
    assert s.mean == 0.5 and s.std == pytest.approx(0.353553, abs=1e-6)
    assert (s.min, s.max, s.samples) == (0.0, 1.0, 6)
    assert s.none_share == pytest.approx(2 / 6)
    # g1 has 1 and 0 (variance); g2 is 0.5, 0.5 (flat); g3 has no valid reward (not a group here)
    assert (s.groups, s.zero_variance_groups, s.flat) == (2, 1, False)
    assert s.as_metrics()["reward/zero_variance_groups"] == 1.0


def test_all_none_batch_has_nan_moments_and_is_not_flat():
    s = batch_stats([None, None], ["g", "g"])
    assert math.isnan(s.mean) and math.isnan(s.std) and s.none_share == 1.0
    assert s.groups == 0 and not s.flat


def test_a_step_without_variance_warns(caplog):
    flat = batch_stats([0.25, 0.25, 1.0, 1.0], ["a", "a", "b", "b"])
    with caplog.at_level(logging.WARNING, "streamrl.rewards"):
        assert warn_if_flat(flat, step=7)
        assert not warn_if_flat(batch_stats([0.0, 1.0], ["a", "a"]), step=8)
    assert (
        len(caplog.records) == 1 and "step 7: all 2 groups have zero reward variance" in caplog.records[0].getMessage()
    )


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="2 rewards for 1 group ids"):
        batch_stats([1.0, 2.0], ["g"])
