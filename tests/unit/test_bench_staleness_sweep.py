"""The staleness sweep's arithmetic on hand-made metric records: the curve, the first step at 0.9, the mean of
the last 10 steps, the staleness the learner trained at, and the plot it writes."""

import pytest

from streamrl.bench.staleness_sweep import CORRECTIONS, _curve, _figures, plot
from streamrl.engine.config import build


def records(rewards):
    # one step every 2 s, the first ending at t = 102 after a 2 s step: the curve's clock starts at 100
    return [{"time": 102.0 + 2 * i, "step_seconds": 2.0, "reward/mean": r, "behavior_kl": 0.1 * i,
             "rejected_fraction": 0.5} for i, r in enumerate(rewards)]  # fmt: skip


def test_curve_and_figures():
    rewards = [0.1] * 5 + [0.5, 0.92, 0.8] + [1.0] * 9  # 17 steps
    recs = records(rewards)
    curve = _curve(recs)
    assert curve[0] == [1, 2.0, 0.1] and curve[6] == [7, 14.0, 0.92]
    out = _figures(recs, curve, {0: 30, 1: 60, 2: 10})
    assert out["steps_to_0.9"] == 7 and out["seconds_to_0.9"] == 14.0  # the first step at or past 0.9
    # last 10 steps: 0.8 and nine 1.0 -> 9.8 / 10
    assert out["reward_last10"] == pytest.approx(0.98)
    assert out["staleness_mean"] == pytest.approx(0.8)  # (0 x 30 + 1 x 60 + 2 x 10) / 100
    assert out["behavior_kl"] == pytest.approx(0.8) and out["rejected_fraction"] == 0.5  # mean of 0.0 .. 1.6


def test_never_reaching_the_target_is_none():
    recs = records([0.2, 0.4, 0.6])
    out = _figures(recs, _curve(recs), {1: 10})
    assert out["steps_to_0.9"] is None and out["seconds_to_0.9"] is None


def test_each_correction_is_a_valid_config_and_the_plot_is_written(tmp_path):
    for sets in CORRECTIONS.values():
        build({}, sets)  # a misspelt field or bad band fails here, not an hour into the sweep
    curves = {"1/default": _curve(records([0.1, 0.9])), "8/cispo": _curve(records([0.2, 0.3]))}
    assert plot(curves, tmp_path).stat().st_size > 10_000


def test_by_version_reads_the_curve_by_the_generating_version():
    from streamrl.bench.staleness_sweep import by_version

    # step k trains at version k - 1 on samples `staleness_mean` versions older
    recs = [{"reward/mean": r, "staleness_mean": s} for r, s in [(0.1, 0.0), (0.5, 1.0), (0.95, 1.0), (0.97, 1.0)]]
    out = by_version(recs)
    assert [v for v, _ in out["reward_by_version"]] == [0.0, 0.0, 1.0, 2.0]
    assert out["version_to_0.9"] == 1.0 and out["last_version"] == 2.0
    assert out["reward_last3"] == pytest.approx((0.5 + 0.95 + 0.97) / 3, abs=1e-4)
