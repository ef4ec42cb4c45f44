"""Policy losses as pure functions of per-token tensors: PPO/GRPO with off-policy correction.

Three policies meet in an asynchronous run: the behavior policy mu that sampled the tokens (the
rollout engine's logprobs, possibly some versions old), the proximal policy pi_prox (the learner's
weights at the start of this step) and pi_theta (the weights being trained). With one optimizer
step per batch pi_prox is pi_theta detached, so the clip ratio is exactly 1 in value and the
gradient is the plain policy gradient: no extra forward pass is needed for it.

`importance` picks how mu enters (the weight w = pi_prox / mu, never differentiated):
- decoupled (AReaL's decoupled PPO): clip pi_theta / pi_prox, multiply by w;
- truncated (TIS): as decoupled with w capped at `is_cap`;
- masked (MIS): as decoupled, tokens whose w leaves [is_mask_low, is_mask_high] get no loss;
- none: classic PPO that treats mu as the old policy: clip pi_theta / mu, no weight.

`ppo` and `grpo` share this surrogate; they differ in where the advantages come from.

Aggregation is expressed as a per-token weight and one normaliser, so that summing the loss of
micro-batches and ranks and dividing by the *global* normaliser gives the same number however the
batch was split:
- token: weight 1, normaliser = loss tokens;
- sequence: weight 1 / (the sequence's loss tokens), normaliser = sequences (mean of means);
- constant (Dr.GRPO): weight 1 / norm_constant, normaliser = sequences.

Statistics come back as sums (and max/min) so they reduce exactly across micro-batches and ranks;
`summarize` turns the reduced sums into means.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from streamrl.engine.config import LossConfig


def k3(log_p: Tensor, log_q: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(q || p) from samples of q: (p/q - 1) - log(p/q), always >= 0."""
    log_ratio = log_p - log_q
    return torch.expm1(log_ratio) - log_ratio


def sequence_lengths(mask: Tensor, seq_ids: Tensor | None) -> Tensor:
    """Loss tokens of each sequence, indexed by `seq_ids` ([T] ints from 0); all one sequence if None.

    Sized T (sequence ids < positions), zeros past the last sequence: sizing it by max(seq_ids), as
    bincount does, is a host sync per micro-batch on CUDA.
    """
    if seq_ids is None:
        return mask.sum().reshape(1).to(torch.float32)
    weights = mask.to(torch.float32)
    return torch.zeros_like(weights).scatter_add_(0, seq_ids, weights)


def token_weights(mask: Tensor, seq_ids: Tensor | None, cfg: LossConfig) -> Tensor:
    """The aggregation weight of every token (0 off the mask)."""
    m = mask.to(torch.float32)
    if cfg.aggregation == "token":
        return m
    if cfg.aggregation == "constant":
        return m / cfg.norm_constant
    lengths = sequence_lengths(mask, seq_ids)
    per_token = lengths[seq_ids] if seq_ids is not None else lengths.expand_as(m)
    return m / per_token.clamp(min=1.0)


def local_normalizer(mask: Tensor, seq_ids: Tensor | None, cfg: LossConfig) -> Tensor:
    """This batch's share of the normaliser: loss tokens (token) or sequences with a loss token."""
    if cfg.aggregation == "token":
        return mask.sum().to(torch.float32)
    return (sequence_lengths(mask, seq_ids) > 0).sum().to(torch.float32)


def importance_weights(proximal: Tensor, behavior: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """(w, keep): the behavior correction per token and which tokens it keeps (masked IS drops some)."""
    raw = torch.exp(proximal - behavior)
    keep = torch.ones_like(raw, dtype=torch.bool)
    if cfg.importance == "none":
        return torch.ones_like(raw), keep
    if cfg.importance == "truncated":
        return raw.clamp(max=cfg.is_cap), keep
    if cfg.importance == "masked":
        keep = (raw >= cfg.is_mask_low) & (raw <= cfg.is_mask_high)
        return torch.where(keep, raw, torch.zeros_like(raw)), keep
    return raw, keep


def clipped_surrogate(ratio: Tensor, advantages: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss -min(r A, clip(r, 1-lo, 1+hi) A), dual-clipped at -c A for A < 0; and where clipped."""
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if cfg.dual_clip > 0:
        bound = -cfg.dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def policy_loss(
    logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    seq_ids: Tensor | None = None,
    proximal_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    normalizer: Tensor | float | None = None,
    same_version: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one batch of tokens (all [T]) and its statistics as sums.

    logprobs: log pi_theta of the taken tokens (differentiable); behavior_logprobs: log mu;
    proximal_logprobs: log pi_prox (default: logprobs detached); ref_logprobs: the reference policy
    for the k3 penalty (needed when kl_coef > 0); seq_ids: sequence index per token (for sequence
    aggregation); normalizer: the global normaliser (default: this batch's own, see module doc);
    same_version: tokens sampled by the weights the learner holds now, where `mismatch_kl` is measured.
    """
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            "loss.kl_coef > 0 needs ref_logprobs (the reference policy's logprobs); "
            "set loss.kl_coef = 0 to train without a reference"
        )
    mask = mask.to(torch.bool)
    proximal = logprobs.detach() if proximal_logprobs is None else proximal_logprobs.detach()
    behavior = behavior_logprobs.detach()
    weight, keep = importance_weights(proximal, behavior, cfg)
    old = behavior if cfg.importance == "none" else proximal
    ratio = torch.exp(logprobs - old)
    per_token, was_clipped = clipped_surrogate(ratio, advantages, cfg)
    per_token = per_token * weight
    if cfg.kl_coef > 0:
        ref_kl = k3(ref_logprobs.detach(), logprobs)
        per_token = per_token + cfg.kl_coef * ref_kl
    agg = token_weights(mask, seq_ids, cfg) * keep
    if normalizer is None:
        normalizer = local_normalizer(mask, seq_ids, cfg)
    loss = (per_token * agg).sum() / torch.as_tensor(normalizer, dtype=torch.float32).clamp(min=1.0)
    stats = _stats(mask, keep, was_clipped, weight, old - logprobs.detach(), k3(proximal, behavior), same_version)
    stats["loss_sum"] = (per_token.detach() * agg).sum()
    if entropy is not None:
        stats["entropy_sum"] = (entropy.detach() * mask).sum()
    if cfg.kl_coef > 0:
        stats["ref_kl_sum"] = (ref_kl.detach() * mask).sum()
    return loss, stats


def _stats(
    mask: Tensor,
    keep: Tensor,
    was_clipped: Tensor,
    weight: Tensor,
    neg_log_ratio: Tensor,
    mismatch: Tensor,
    same_version: Tensor | None,
) -> dict[str, Tensor]:
    m = mask.to(torch.float32)
    kept = mask & keep
    at_version = mask if same_version is None else mask & same_version.to(torch.bool)
    return {
        "tokens": m.sum(),
        "clipped_sum": (was_clipped & kept).sum().to(torch.float32),
        "ppo_kl_sum": (neg_log_ratio * m).sum(),
        "is_weight_sum": (weight * kept).sum(),
        # no `if kept.any()` and no host-made inf tensor: each is a host sync per micro-batch on CUDA
        "is_weight_max": torch.where(kept, weight, -math.inf).max(),
        "is_weight_min": torch.where(kept, weight, math.inf).min(),
        "is_masked_sum": (mask & ~keep).sum().to(torch.float32),
        "mismatch_kl_sum": (mismatch * at_version).sum(),
        "behavior_kl_sum": (mismatch * m).sum(),
        "mismatch_tokens": at_version.sum().to(torch.float32),
    }


def summarize(stats: dict[str, float]) -> dict[str, float]:
    """Means from (reduced) sums: clip_fraction, ppo_kl, is_weight_mean, mismatch_kl, entropy, ..."""
    tokens = max(stats.get("tokens", 0.0), 1.0)
    kept = max(tokens - stats.get("is_masked_sum", 0.0), 1.0)
    out = {
        "tokens": stats.get("tokens", 0.0),
        "clip_fraction": stats.get("clipped_sum", 0.0) / kept,
        "ppo_kl": stats.get("ppo_kl_sum", 0.0) / tokens,
        "is_weight_mean": stats.get("is_weight_sum", 0.0) / kept,
        "is_masked_fraction": stats.get("is_masked_sum", 0.0) / tokens,
        # Trainer-inference mismatch is only defined on tokens sampled by the weights the learner
        # holds; a step with none (every sample a version behind) has no measurement, not a zero.
        "mismatch_kl": (
            stats.get("mismatch_kl_sum", 0.0) / stats["mismatch_tokens"]
            if stats.get("mismatch_tokens", 0.0) > 0
            else float("nan")
        ),
        # The whole off-policy gap (staleness + mismatch): k3 between pi_prox and the behavior policy.
        "behavior_kl": stats.get("behavior_kl_sum", 0.0) / tokens,
    }
    for key in ("is_weight_max", "is_weight_min"):
        if key in stats:  # +-inf when no token was kept: reported as 0 so metric sinks stay valid JSON
            out[key] = stats[key] if math.isfinite(stats[key]) else 0.0
    for key in ("entropy", "ref_kl"):
        if f"{key}_sum" in stats:
            out[key] = stats[f"{key}_sum"] / tokens
    return out
