"""The critic's loss and statistics as pure functions of per-token tensors ([T] each).

Value loss (verl `compute_value_loss`, OpenRLHF `ValueLoss`, TRL PPOTrainer's `vf_loss`):
    l_t = (V_t - R_t)^2                                                 (clip = 0)
    l_t = max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)   (clip = c > 0)
    loss = 0.5 x sum_t w_t l_t / N
with V the critic being trained, V_old its values when the step's advantages were computed (before the
step's first update), R the lambda-returns. w and N are the policy loss's token weights and global
normaliser (learner/losses.py `token_weights`, the step's normaliser), so micro-batches and ranks do not
change it: token-mean by default, as verl's `loss_agg_mode = token-mean`.

Statistics come back as sums (and max/min) to reduce over micro-batches and ranks; `summarize` turns them into
vf_loss (an unweighted mean over the loss tokens, as verl logs it: with `loss.aggregation = "sequence"` it is
not the weighted objective above, which the gradient follows), vf_clipfrac, vf_explained_var (1 - Var(R - V_old)
/ Var(R), over the step's loss tokens), value mean/min/max and returns mean. The trainer also reports
vf_explained_var_last, over each completion's last token only: with the reward at the end and lambda = 1 every
token's target is the outcome, which the first tokens cannot know (it is drawn after them), so the all-token
figure is bounded by how much of the outcome a prefix decides (about a half for an outcome that is a mean over
i.i.d. tokens); at the last token the whole completion but one token is seen.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    weights: Tensor,
    normalizer: Tensor | float,
    clip: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, sums): `values` differentiable; `old_values`, `returns` fixed targets; `weights` 0 off the mask."""
    m = mask.to(torch.bool)
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns).square()
    if clip > 0:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        was_clipped = m & (clipped > unclipped)
    else:
        per_token, was_clipped = unclipped, torch.zeros_like(m)
    per_token = torch.where(m, per_token, 0.0)
    n = torch.as_tensor(normalizer, dtype=torch.float32, device=values.device).clamp(min=1.0)
    loss = 0.5 * (per_token * weights).sum() / n
    stats = {
        "vf_tokens": m.sum().to(torch.float32),
        "vf_loss_sum": 0.5 * per_token.detach().sum(),
        "vf_clipped_sum": was_clipped.sum().to(torch.float32),
    }
    return loss, stats


def value_stats(old_values: Tensor, returns: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sums of the values and returns the step's advantages were made from (explained variance, means)."""
    m = mask.to(torch.bool)
    v = torch.where(m, old_values.to(torch.float64), 0.0)
    r = torch.where(m, returns.to(torch.float64), 0.0)
    return {
        "value_tokens": m.sum().to(torch.float64),
        "value_sum": v.sum(),
        "value_max": torch.where(m, old_values.to(torch.float64), -math.inf).max(),
        "value_min": torch.where(m, old_values.to(torch.float64), math.inf).min(),
        "returns_sum": r.sum(),
        "returns_sq_sum": r.square().sum(),
        "residual_sum": (r - v).sum(),
        "residual_sq_sum": (r - v).square().sum(),
    }


def summarize(stats: dict[str, float]) -> dict[str, float]:
    """Means from reduced sums. Explained variance is absent when the returns have no variance (every
    completion scored the same): 1 - x / 0 is no measurement."""
    out: dict[str, float] = {}
    if stats.get("vf_tokens", 0.0) > 0:
        out["vf_loss"] = stats["vf_loss_sum"] / stats["vf_tokens"]
        out["vf_clipfrac"] = stats["vf_clipped_sum"] / stats["vf_tokens"]
    n = stats.get("value_tokens", 0.0)
    if n <= 0:
        return out
    out["value_mean"] = stats["value_sum"] / n
    out["value_max"], out["value_min"] = stats["value_max"], stats["value_min"]
    out["returns_mean"] = stats["returns_sum"] / n
    var_returns = stats["returns_sq_sum"] / n - out["returns_mean"] ** 2
    var_residual = stats["residual_sq_sum"] / n - (stats["residual_sum"] / n) ** 2
    if var_returns > 1e-12:
        out["vf_explained_var"] = 1.0 - var_residual / var_returns
    return out
