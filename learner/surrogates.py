"""Policy surrogates (`loss.surrogate`): the per-token policy term of the PPO ratio r = pi_theta / pi_old.

Each takes the clamped log-ratio (with its gradient; GSPO's form when `ratio_level = "sequence"`),
pi_theta's log-probs, the advantages, the loss mask and the sequence ids, and returns the per-token loss
(before the importance weight and aggregation, which `losses.policy_loss` applies alike) and where the
ratio was clipped (`clip_fraction`).

- ppo_clip (PPO, Schulman et al. 2017): -min(r A, clip(r, 1 - lo, 1 + hi) A), dual-clipped at -c A for
  A < 0 (`dual_clip`). Past the clip a token has no gradient: an update whose tokens are all clipped has none.
- cispo (MiniMax-M1, 2025): -sg(clip(r, 1 - lo, 1 + hi)) A log pi_theta. The clipped ratio is a stopped
  weight, so every token keeps the gradient A w grad log pi, bounded by the clip. verl's `cispo` clamps both
  sides; TRL's (`loss_type="cispo"`) only from above, at `epsilon_high` (= 1 + clip_high here; clip_low = 1
  is no lower bound).
- sapo (SAPO, Gao et al. 2025): -(4 / tau) sigmoid(tau (r - 1)) A with tau = sapo_tau_pos for A > 0, else
  sapo_tau_neg: a soft gate whose gradient, r sigmoid'(...) 4 A, is A at r = 1 and fades smoothly with
  |r - 1| instead of dropping to 0 at a clip. Nothing is clipped (`clip_fraction` 0), as in TRL and verl.
- gmpo (GMPO, Zhao et al. 2025; verl `geo_mean`): per sequence -A_i exp(mean_t l_t), l_t the token's
  log-ratio clipped to [-lo, hi] on the side its advantage pushes (sgn(A) min(sgn(A) log r, sgn(A)
  clip(log r))), A_i the mean advantage of the sequence. Every token of the sequence carries that value;
  aggregated as mean of per-sequence means (`aggregation = "sequence"`, the gmpo preset) it is verl's mean
  over sequences. verl weights a sequence by the geometric mean of its importance weights: `policy_loss`
  does that for gmpo (`sequence_weight`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from streamrl.engine.config import LossConfig
from streamrl.learner.token_sums import per_token, sequence_means

Surrogate = Callable[[Tensor, Tensor, Tensor, Tensor, "Tensor | None", LossConfig], tuple[Tensor, Tensor]]


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


def ppo_clip(log_ratio: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, seq_ids, cfg: LossConfig):
    return clipped_surrogate(torch.exp(log_ratio), advantages, cfg)


def cispo(log_ratio: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, seq_ids, cfg: LossConfig):
    ratio = torch.exp(log_ratio.detach())
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    return -clipped * advantages * logprobs, clipped != ratio


def sapo(log_ratio: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, seq_ids, cfg: LossConfig):
    pos, neg = torch.full_like(log_ratio, cfg.sapo_tau_pos), torch.full_like(log_ratio, cfg.sapo_tau_neg)
    tau = torch.where(advantages > 0, pos, neg)
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    return -gate * advantages, torch.zeros_like(mask, dtype=torch.bool)


def gmpo(log_ratio: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, seq_ids, cfg: LossConfig):
    sign = torch.sign(advantages)
    clipped = log_ratio.clamp(-cfg.clip_low, cfg.clip_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clipped)
    ratio = torch.exp(per_token(sequence_means(kept, mask, seq_ids), seq_ids, log_ratio))
    advantage = per_token(sequence_means(advantages, mask, seq_ids), seq_ids, advantages)
    return -advantage * ratio, clipped != log_ratio


def sequence_weight(weight: Tensor, mask: Tensor, seq_ids: Tensor | None) -> Tensor:
    """Every token's weight replaced by its sequence's geometric mean, as verl's geo_mean aggregates
    `rollout_is_weights` (a weight of 0, a token kept out, counts as 1e-10, as there)."""
    log_w = torch.log(weight + 1e-10)
    return torch.exp(per_token(sequence_means(log_w, mask, seq_ids), seq_ids, weight))


SURROGATES: dict[str, Surrogate] = {"ppo_clip": ppo_clip, "cispo": cispo, "sapo": sapo, "gmpo": gmpo}


def surrogate(
    log_ratio: Tensor, logprobs: Tensor, advantages: Tensor, mask: Tensor, seq_ids: Tensor | None, cfg: LossConfig
) -> tuple[Tensor, Tensor]:
    """(per-token loss, was_clipped) of `cfg.surrogate`; all [T]."""
    return SURROGATES[cfg.surrogate](log_ratio, logprobs, advantages, mask, seq_ids, cfg)
