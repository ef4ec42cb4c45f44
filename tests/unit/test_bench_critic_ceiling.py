"""The critic ceiling bench's arithmetic: explained variance with the Monte Carlo estimate's noise taken out."""

import pytest
import torch

from streamrl.bench.critic_ceiling import explained


def test_the_estimates_noise_is_taken_out_of_the_residual():
    returns = torch.tensor([0.0, 1.0, 0.0, 1.0])  # mean 0.5, unbiased var 4 x 0.25 / 3 = 1/3
    values = torch.tensor([0.25, 0.75, 0.25, 0.75])  # residual -0.25, 0.25, -0.25, 0.25: var 4 x 0.0625 / 3 = 1/12
    noise = torch.tensor([0.02, 0.02, 0.04, 0.04])  # mean 0.03
    corrected, raw = explained(values, noise, returns)
    assert raw == pytest.approx(1 - (1 / 12) / (1 / 3))  # 0.75
    assert corrected == pytest.approx(0.75 + 0.03 / (1 / 3))  # 0.84


def test_noise_free_exact_values_explain_everything():
    returns = torch.tensor([0.1, 0.4, 0.2])
    assert explained(returns.clone(), torch.zeros(3), returns) == pytest.approx((1.0, 1.0))
