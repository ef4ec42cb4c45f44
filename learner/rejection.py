"""Rejection of stale tokens or sequences (`loss.rejection`): pure functions of per-token tensors.

With log r = log(pi_prox / mu) per token (clamped to +-`log_ratio_clamp`, as verl's 20), a statistic
(`metric`) is kept inside a band [lower, upper] (either bound may be unset):
- ratio: r; a sequence's in log space (sum: exp(sum log r), the sequence weight; mean: the geometric mean;
  max: the largest token ratio), as AReaL aggregates it;
- k1: -log r = log(mu / pi_prox), verl's sign (AReaL's kl_k1 is +log r: its band is this one negated);
- k2: (log r)^2 / 2;
- k3: r - 1 - log r, verl's (AReaL's kl_k3 is 1/r - 1 + log r, the same to second order in log r);
and at sequence level the k's are summed, averaged or maxed arithmetically over the sequence's loss tokens.
Out of the band, a token (or every token of the sequence) is rejected: with `action = "mask"` it gets no
policy loss; with `action = "clamp"` (metric ratio) its importance weight is clamped into the band. An
`advantage` gate limits this to tokens whose advantage is negative (DeepSeek-V3.2's off-policy sequence
mask, TRL `off_policy_mask_threshold`) or positive.

Where the peers differ: verl removes a rejected token from the response mask, so it leaves the
normaliser and the KL term too; here it stays in the normaliser, as a masked importance weight does (and
TRL's off-policy mask, a factor on the policy loss). TRL measures its mask against pi_theta (detached) at
each update, here against pi_prox, the same on a step's first update.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from streamrl.engine.config.rejection import RejectionConfig
from streamrl.learner.token_sums import per_token, sequence_maxes, sequence_means, sequence_sums

_REDUCE = {"sum": sequence_sums, "mean": sequence_means, "max": sequence_maxes}


def token_statistic(log_r: Tensor, metric: str) -> Tensor:
    """The per-token statistic of log r = log(pi_prox / mu); ratio in log space (log r itself)."""
    if metric == "ratio":
        return log_r
    if metric == "k1":
        return -log_r
    if metric == "k2":
        return 0.5 * log_r.square()
    return torch.expm1(log_r) - log_r


def statistic(log_r: Tensor, mask: Tensor, seq_ids: Tensor | None, cfg: RejectionConfig) -> Tensor:
    """Each token's statistic at `cfg.level` (a sequence's, aggregated, on all its tokens); log of it for ratio."""
    values = token_statistic(log_r, cfg.metric)
    if cfg.level == "token":
        return values
    return per_token(_REDUCE[cfg.aggregation](values, mask, seq_ids), seq_ids, values)


def _band(cfg: RejectionConfig) -> tuple[float, float]:
    """[lower, upper] in the statistic's units (log for ratio, where a lower bound of 0 is none)."""
    if cfg.metric != "ratio":
        return cfg.lower, cfg.upper
    low = math.log(cfg.lower) if cfg.lower > 0 else -math.inf
    return low, math.log(cfg.upper)


def rejected(
    proximal: Tensor,
    behavior: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_ids: Tensor | None,
    cfg: RejectionConfig,
    clamp: float = 20.0,
) -> Tensor:
    """Loss tokens outside the band (and past the advantage gate): bool [T]; none when `level = "none"`."""
    mask = mask.to(torch.bool)
    if cfg.level == "none":
        return torch.zeros_like(mask)
    log_r = (proximal.detach() - behavior.detach()).clamp(-clamp, clamp)
    value = statistic(log_r, mask, seq_ids, cfg)
    low, high = _band(cfg)
    out = ~((value >= low) & (value <= high))
    if cfg.advantage == "negative":
        out = out & (advantages < 0)
    elif cfg.advantage == "positive":
        out = out & (advantages > 0)
    return out & mask


def apply(weight: Tensor, keep: Tensor, out: Tensor, cfg: RejectionConfig) -> tuple[Tensor, Tensor]:
    """(weight, keep) after rejection: `out` tokens lose their policy loss (mask), or their weight is
    clamped into [lower, upper] (clamp)."""
    if cfg.action == "mask":
        keep = keep & ~out
        return torch.where(keep, weight, torch.zeros_like(weight)), keep
    return torch.where(out & keep, weight.clamp(max(cfg.lower, 0.0), cfg.upper), weight), keep
