"""The reward-model score mapping and its start-up range check, against hand-worked numbers."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.engine.config import RewardModelConfig
from streamrl.rewards.model import map_scores, range_warnings


def test_sigmoid_after_scale_and_shift():
    cfg = RewardModelConfig(transform="sigmoid", scale=1.0, shift=11.5, clip_low=0.0, clip_high=1.0)
    # -15 + 11.5 = -3.5 -> 1 / (1 + e^3.5) = 0.029312; -11.5 -> 0 -> 0.5; -8 -> 3.5 -> 0.970688
    out = map_scores(torch.tensor([-15.0, -11.5, -8.0]), cfg)
    assert out.tolist() == pytest.approx([0.029312, 0.5, 0.970688], abs=1e-6)


def test_tanh_and_none_with_clipping():
    tanh = RewardModelConfig(transform="tanh", scale=0.5, shift=5.75, clip_low=-1.0, clip_high=1.0)
    # -15 * 0.5 + 5.75 = -1.75 -> tanh = -0.941376; -8 * 0.5 + 5.75 = 1.75 -> 0.941376
    assert map_scores(torch.tensor([-15.0, -8.0]), tanh).tolist() == pytest.approx([-0.941376, 0.941376], abs=1e-6)
    none = RewardModelConfig(transform="none", scale=2.0, shift=1.0, clip_low=-3.0, clip_high=3.0)
    # 2 * -3 + 1 = -5 -> clipped to -3; 2 * 0.5 + 1 = 2 -> 2; 2 * 4 + 1 = 9 -> clipped to 3
    assert map_scores(torch.tensor([-3.0, 0.5, 4.0]), none).tolist() == [-3.0, 2.0, 3.0]


def test_range_check_flags_far_out_and_constant_scores():
    cfg = RewardModelConfig(transform="none", clip_low=-1.0, clip_high=1.0)
    # width 2: "far" is below -3 or above 3; raw -15..-8 are far below; the hint centres at 11.5
    problems = range_warnings(torch.tensor([-15.0, -8.0]), cfg)
    assert len(problems) == 1 and "far outside" in problems[0] and "shift = 11.5" in problems[0]
    assert range_warnings(torch.tensor([-2.5, 2.5]), cfg) == []  # outside the clip range, but not far
    constant = range_warnings(torch.tensor([0.3, 0.3, 0.3]), cfg)
    assert len(constant) == 1 and "same score 0.3" in constant[0]
    sigmoid = RewardModelConfig(transform="sigmoid", clip_low=0.0, clip_high=1.0)
    # sigmoid(-15) = 3.1e-7 and sigmoid(-8) = 3.4e-4: in range, but within 1e-6 of each other? no:
    # they differ by 3.3e-4 > 1e-6, so not constant; sigmoid(-40) vs sigmoid(-30) differ by ~9e-14: constant
    assert range_warnings(torch.tensor([-15.0, -8.0]), sigmoid) == []
    assert "same score" in range_warnings(torch.tensor([-40.0, -30.0]), sigmoid)[0]
    assert math.isclose(float(torch.sigmoid(torch.tensor(-8.0))), 3.354e-4, rel_tol=1e-3)
