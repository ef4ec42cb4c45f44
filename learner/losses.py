"""Policy losses as pure functions of per-token tensors: PPO/GRPO with off-policy correction.

Three policies meet in an asynchronous run: the behavior policy mu that sampled the tokens (the
rollout engine's logprobs, possibly some versions old), the proximal policy pi_prox (the learner's
weights at the start of this step) and pi_theta (the weights being trained). The caller passes
pi_prox as `proximal_logprobs` (computed once, without grad, before a step's first update); without
it pi_prox is pi_theta detached, so the PPO ratio is exactly 1 and the gradient is the plain policy
gradient (the clip can only act from a step's second update on).

`importance` picks how mu enters, through w = pi_prox / mu (never differentiated), at the level
`importance_level` (token: one w per token; sequence: w = exp(sum of the sequence's token
log-ratios) = pi_prox(y) / mu(y), one w for all its tokens):
- truncated (TIS, the default, per token with cap 3): clip pi_theta / pi_prox, multiply by w
  clamped to [is_low, is_high];
- masked (MIS): as truncated, but tokens or sequences whose w leaves [is_low, is_high] get no
  policy loss instead;
- decoupled (AReaL's decoupled PPO): w unbounded but for the log-ratio clamp;
- none: classic PPO that treats mu as the old policy: clip pi_theta / mu, no weight.
Why the default is token-level truncation: see `LossConfig`; docs/ALGORITHMS.md has the formulas,
the verl/TRL names and the measurement behind the choice.

`ratio_level = "sequence"` is GSPO: the PPO ratio of every token of a sequence is the geometric mean
of the sequence's token ratios, so the clip acts per sequence. In value exp(mean log-ratio); in
gradient each token's own log-prob (GSPO-token, as verl computes it), which for one advantage per
sequence is GSPO's gradient.

Every log-ratio is clamped to +-`log_ratio_clamp` before exp (as verl's 20): unclamped, a log-ratio
of 100 is inf in fp32, which makes an infinite loss (negative advantage) or a NaN gradient (0 x inf
through the clipped branch). Beyond the clamp the token gets no gradient; the PPO clip had already
cut it off.

The reference KL (`kl_coef`, estimator `kl_estimator`) and the entropy bonus (`entropy_coef`) are
added per token on every loss token, masked by importance or not, as TRL and verl add theirs.

Aggregation is expressed as a per-token weight and one normaliser, so that summing the loss of
micro-batches and ranks and dividing by the *global* normaliser gives the same number however the
batch was split:
- token: weight 1, normaliser = loss tokens;
- sequence: weight 1 / (the sequence's loss tokens), normaliser = sequences (mean of means);
- constant (Dr.GRPO): weight 1 / norm_constant, normaliser = sequences.
Sequence-level quantities are summed over `seq_ids` inside one call, so a sequence must not be split
across micro-batches (batching.py never splits one).

Statistics come back as sums (and max/min) so they reduce exactly across micro-batches and ranks;
`summarize` turns the reduced sums into means. Two diagnostics: `ppo_kl` is KL(pi_prox || pi_theta), k3
weighted by pi_prox / mu (how far the step's updates moved the policy; `_ppo_kl`); `mismatch_kl` is k3 of
pi_prox against mu on the tokens sampled by the weights the learner holds (the kernel mismatch alone),
absent when a step has none, with `mismatch_samples` the samples it was measured on.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from streamrl.engine.config import LossConfig
from streamrl.learner import rejection
from streamrl.learner.surrogates import clipped_surrogate, sequence_weight, surrogate
from streamrl.learner.token_sums import per_token, sequence_lengths, sequence_sums

__all__ = [  # the sequence helpers and the PPO surrogate are imported from here by others
    "clipped_surrogate",
    "importance_weights",
    "kl_estimate",
    "local_normalizer",
    "per_token",
    "policy_loss",
    "sequence_lengths",
    "sequence_sums",
    "summarize",
    "token_weights",
]


def kl_estimate(log_p: Tensor, log_q: Tensor, estimator: str = "k3", clamp: float = 20.0) -> Tensor:
    """Per-token estimate of KL(q || p) from samples of q, with log r = log p - log q clamped to +-clamp.

    k1 = -log r (unbiased, can be negative); k2 = (log r)^2 / 2 (biased, >= 0); k3 = (r - 1) - log r
    (unbiased, >= 0, lowest variance when p is near q). Schulman, "Approximating KL divergence" (2020).
    """
    log_r = (log_p - log_q).clamp(-clamp, clamp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"loss.kl_estimator = {estimator!r} is unknown; use k1, k2 or k3")


def k3(log_p: Tensor, log_q: Tensor, clamp: float = 20.0) -> Tensor:
    """Per-token k3 estimate of KL(q || p) from samples of q: (p/q - 1) - log(p/q), always >= 0."""
    return kl_estimate(log_p, log_q, "k3", clamp)


def token_weights(mask: Tensor, seq_ids: Tensor | None, cfg: LossConfig) -> Tensor:
    """The aggregation weight of every token (0 off the mask)."""
    m = mask.to(torch.float32)
    if cfg.aggregation == "token":
        return m
    if cfg.aggregation == "constant":
        return m / cfg.norm_constant
    return m / per_token(sequence_lengths(mask, seq_ids), seq_ids, m).clamp(min=1.0)


def local_normalizer(mask: Tensor, seq_ids: Tensor | None, cfg: LossConfig) -> Tensor:
    """This batch's share of the normaliser: loss tokens (token) or sequences with a loss token."""
    if cfg.aggregation == "token":
        return mask.sum().to(torch.float32)
    return (sequence_lengths(mask, seq_ids) > 0).sum().to(torch.float32)


def importance_weights(
    proximal: Tensor,
    behavior: Tensor,
    cfg: LossConfig,
    *,
    mask: Tensor | None = None,
    seq_ids: Tensor | None = None,
    level: str | None = None,
) -> tuple[Tensor, Tensor]:
    """(w, keep): the behavior correction pi_prox / mu per token and which tokens it keeps (masked IS drops some).

    At sequence level (`level`, default `cfg.importance_level`) every token carries its sequence's w, from
    the log-ratios on `mask` (default: every token). Bounds are compared in log space on the unclamped
    log-ratio, so a sequence whose log-ratio is past the clamp is still masked; w itself is exp of the
    clamped log-ratio.
    """
    log_w = proximal - behavior
    if (level or cfg.importance_level) == "sequence":
        mask = torch.ones_like(log_w, dtype=torch.bool) if mask is None else mask
        log_w = per_token(sequence_sums(log_w, mask, seq_ids), seq_ids, log_w)
    keep = torch.ones_like(log_w, dtype=torch.bool)
    if cfg.importance == "none":
        return torch.ones_like(log_w), keep
    low = math.log(cfg.is_low) if cfg.is_low > 0 else -math.inf
    high = math.log(cfg.is_high)
    if cfg.importance == "truncated":
        log_w = log_w.clamp(low, high)
    elif cfg.importance == "masked":
        keep = (log_w >= low) & (log_w <= high)
    w = torch.exp(log_w.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    return torch.where(keep, w, torch.zeros_like(w)), keep


def ppo_log_ratio(logprobs: Tensor, old: Tensor, mask: Tensor, seq_ids: Tensor | None, cfg: LossConfig) -> Tensor:
    """log(pi_theta / pi_old) per token, clamped to +-log_ratio_clamp; per sequence (GSPO) when ratio_level says so.

    GSPO's value is the sequence's mean token log-ratio, its gradient each token's own log-prob:
    log s_t = log pi_t - sg(log pi_t) + sg(mean log-ratio of the sequence).
    """
    log_ratio = logprobs - old
    if cfg.ratio_level == "sequence":
        lengths = sequence_lengths(mask, seq_ids).clamp(min=1.0)
        mean = sequence_sums(log_ratio.detach(), mask, seq_ids) / lengths
        log_ratio = logprobs - logprobs.detach() + per_token(mean, seq_ids, logprobs)
    return log_ratio.clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)


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
    (needed when kl_coef > 0); entropy: pi_theta's entropy per position (needed, differentiable, when
    entropy_coef > 0; else only a statistic); seq_ids: sequence index per token (for sequence
    aggregation, sequence-level weights and GSPO; None: all one sequence); normalizer: the global
    normaliser (default: this batch's own, see module doc); same_version: tokens sampled by the
    weights the learner holds now, where `mismatch_kl` is measured.
    """
    _check_inputs(cfg, logprobs, ref_logprobs, entropy)
    mask = mask.to(torch.bool)
    proximal = logprobs.detach() if proximal_logprobs is None else proximal_logprobs.detach()
    behavior = behavior_logprobs.detach()
    out = rejection.rejected(proximal, behavior, advantages, mask, seq_ids, cfg.rejection, cfg.log_ratio_clamp)
    weight, keep = rejection.apply(
        *importance_weights(proximal, behavior, cfg, mask=mask, seq_ids=seq_ids), out, cfg.rejection
    )
    old = behavior if cfg.importance == "none" else proximal
    log_ratio = ppo_log_ratio(logprobs, old, mask, seq_ids, cfg)
    policy, was_clipped = surrogate(log_ratio, logprobs, advantages, mask, seq_ids, cfg)
    if cfg.surrogate == "gmpo":
        weight = sequence_weight(weight, mask, seq_ids)
    # where() rather than a product: a kept-out token's surrogate never reaches the sum, not even as 0 x inf
    loss_per_token = torch.where(keep, policy * weight, torch.zeros_like(policy))
    if cfg.kl_coef > 0:
        ref_kl = reference_kl(logprobs, proximal, behavior, ref_logprobs, out, cfg)
        loss_per_token = loss_per_token + cfg.kl_coef * ref_kl
    if cfg.entropy_coef > 0:
        loss_per_token = loss_per_token - cfg.entropy_coef * entropy
    agg = token_weights(mask, seq_ids, cfg)
    if normalizer is None:
        normalizer = local_normalizer(mask, seq_ids, cfg)
    loss = (loss_per_token * agg).sum() / torch.as_tensor(normalizer, dtype=torch.float32).clamp(min=1.0)
    mismatch = k3(proximal, behavior, cfg.log_ratio_clamp)
    stats = _stats(mask, keep, was_clipped, weight, mismatch, same_version, seq_ids)
    stats.update(_ppo_kl(logprobs.detach(), proximal, behavior, mask, cfg.log_ratio_clamp))
    stats["loss_sum"] = (loss_per_token.detach() * agg).sum()
    stats["rejected_sum"] = out.sum().to(torch.float32)
    if entropy is not None:
        stats["entropy_sum"] = (entropy.detach() * mask).sum()
    if cfg.kl_coef > 0:
        stats["ref_kl_sum"] = (ref_kl.detach() * mask).sum()
    return loss, stats


def reference_kl(
    logprobs: Tensor, proximal: Tensor, behavior: Tensor, ref_logprobs: Tensor, rejected: Tensor, cfg: LossConfig
) -> Tensor:
    """Per-token reference-KL term: the `kl_estimator` estimate, with `kl_correction` weighted by pi_theta / mu.

    The weight is pi_prox / mu bounded as the policy's (`importance`, per token: a per-token term wants the
    token's own ratio, not its sequence's; rejection applied alike) times pi_theta / pi_prox, differentiated.
    Then E_mu[weight x KL_t] = E_pi_theta[KL_t] and its gradient is the gradient of that expectation, exactly
    (while the bound does not act): on mu's samples the term is what it is on pi_theta's own, whatever the
    staleness. Without it the term estimates E_mu[KL_t] and its gradient E_mu[grad KL_t], which on stale
    samples is neither (docs/ALGORITHMS.md section 4 has the measurement). On pi_theta's own samples the
    weight is 1 in value; its gradient adds KL_t grad log pi_theta, which makes k1 and k3 give the gradient of
    KL(pi_theta || ref) itself. With `importance = "none"` the weight is pi_theta / mu, only log-clamped.
    """
    estimate = kl_estimate(ref_logprobs.detach(), logprobs, cfg.kl_estimator, cfg.log_ratio_clamp)
    if not cfg.kl_correction:
        return estimate
    weight, keep = importance_weights(proximal, behavior, cfg, level="token")
    weight, _ = rejection.apply(weight, keep, rejected, cfg.rejection)
    old = behavior if cfg.importance == "none" else proximal
    ratio = torch.exp((logprobs - old).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp))
    return weight * ratio * estimate


def _check_inputs(cfg: LossConfig, logprobs: Tensor, ref_logprobs: Tensor | None, entropy: Tensor | None) -> None:
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            "loss.kl_coef > 0 needs ref_logprobs (the reference policy's logprobs); "
            "set loss.kl_coef = 0 to train without a reference"
        )
    if cfg.entropy_coef > 0 and (entropy is None or (logprobs.requires_grad and not entropy.requires_grad)):
        raise ValueError(
            "loss.entropy_coef > 0 needs the policy entropy with its gradient (the forward gave "
            f"{'none' if entropy is None else 'one without a gradient'}); set loss.entropy_coef = 0"
        )


def _ppo_kl(logprobs: Tensor, proximal: Tensor, behavior: Tensor, mask: Tensor, clamp: float) -> dict[str, Tensor]:
    """KL(pi_prox || pi_theta), how far the step's updates have moved the policy, as sums.

    Per token k3 = r - 1 - log r with r = pi_theta / pi_prox (>= 0; 0 on a step's first update), weighted
    by pi_prox / mu and self-normalised: the tokens were sampled from mu, not pi_prox, so an unweighted mean
    over-counts the tokens pi_prox finds unlikely (the k1 mean of log(pi_prox / pi_theta) this replaces
    read 1.65 at staleness 4 where the exact KL was 0.01-0.03). The weight is the raw per-token ratio (only
    the log-ratio clamp), whatever `importance` does to the loss."""
    m = mask.to(torch.float32)
    w = torch.exp((proximal - behavior).clamp(-clamp, clamp)) * m
    return {"ppo_kl_sum": (w * k3(logprobs, proximal, clamp)).sum(), "ppo_kl_weight": w.sum()}


def _stats(
    mask: Tensor,
    keep: Tensor,
    was_clipped: Tensor,
    weight: Tensor,
    mismatch: Tensor,
    same_version: Tensor | None,
    seq_ids: Tensor | None,
) -> dict[str, Tensor]:
    m = mask.to(torch.float32)
    kept = mask & keep
    at_version = mask if same_version is None else mask & same_version.to(torch.bool)
    return {
        "tokens": m.sum(),
        "clipped_sum": (was_clipped & kept).sum().to(torch.float32),
        "is_weight_sum": (weight * kept).sum(),
        # no `if kept.any()` and no host-made inf tensor: each is a host sync per micro-batch on CUDA
        "is_weight_max": torch.where(kept, weight, -math.inf).max(),
        "is_weight_min": torch.where(kept, weight, math.inf).min(),
        "is_masked_sum": (mask & ~keep).sum().to(torch.float32),
        "mismatch_kl_sum": (mismatch * at_version).sum(),
        "behavior_kl_sum": (mismatch * m).sum(),
        "mismatch_tokens": at_version.sum().to(torch.float32),
        "mismatch_samples": (sequence_lengths(at_version, seq_ids) > 0).sum().to(torch.float32),
    }


def summarize(stats: dict[str, float]) -> dict[str, float]:
    """Means from (reduced) sums: clip_fraction, ppo_kl, is_weight_mean, mismatch_kl, entropy, ..."""
    tokens = max(stats.get("tokens", 0.0), 1.0)
    kept = max(tokens - stats.get("is_masked_sum", 0.0), 1.0)
    out = {
        "tokens": stats.get("tokens", 0.0),
        "clip_fraction": stats.get("clipped_sum", 0.0) / kept,
        "ppo_kl": stats.get("ppo_kl_sum", 0.0) / stats["ppo_kl_weight"] if stats.get("ppo_kl_weight", 0.0) > 0 else 0.0,
        "is_weight_mean": stats.get("is_weight_sum", 0.0) / kept,
        "is_masked_fraction": stats.get("is_masked_sum", 0.0) / tokens,
        # The whole off-policy gap (staleness + mismatch): k3 between pi_prox and the behavior policy.
        "behavior_kl": stats.get("behavior_kl_sum", 0.0) / tokens,
        "mismatch_samples": stats.get("mismatch_samples", 0.0),
        # loss tokens `loss.rejection` acted on (masked out, or their weight clamped)
        "rejected_fraction": stats.get("rejected_sum", 0.0) / tokens,
    }
    # Trainer-inference mismatch is only defined on tokens sampled by the weights the learner holds; a step
    # with none (every sample a version behind) has no measurement: the key is absent, not a zero or a NaN.
    if stats.get("mismatch_tokens", 0.0) > 0:
        out["mismatch_kl"] = stats.get("mismatch_kl_sum", 0.0) / stats["mismatch_tokens"]
    for key in ("is_weight_max", "is_weight_min"):
        if key in stats:  # +-inf when no token was kept: reported as 0 so metric sinks stay valid JSON
            out[key] = stats[key] if math.isfinite(stats[key]) else 0.0
    for key in ("entropy", "ref_kl"):
        if f"{key}_sum" in stats:
            out[key] = stats[f"{key}_sum"] / tokens
    return out
