"""Per-token advantages and returns as pure functions of [B, L] tensors (one row per completion), and the
packed <-> rows layout that brings the learner's micro-batches to them.

A completion's outcome reward sits at its last loss token (`token_rewards`), optionally with a per-token KL
penalty against the reference subtracted on every loss token (verl's `use_kl_in_reward`, OpenRLHF's
`compute_reward`). Only loss tokens are steps of the trajectory: a position off the mask (a multi-turn
episode's environment tokens, padding) is skipped, carrying the running sums over it, as verl's masked GAE
does; its own advantage and return are 0.

- `gae`: delta_t = r_t + gamma V_{t+1} - V_t (V after the last token is 0: a completion ends the episode,
  cut by max_tokens or not); A_t = delta_t + gamma lam A_{t+1}; returns R_t = A_t + V_t (the lambda-return,
  the critic's target). verl `compute_gae_advantage_return`, OpenRLHF `get_advantages_and_returns`.
- `discounted_returns`: G_t = r_t + gamma G_{t+1}: GAE with V = 0 and lam = 1 (REINFORCE++'s returns).
- `whiten`: (x - mean) / sqrt(var + eps) over every loss token of the batch, the mean not added back
  (verl `masked_whiten`, shift_mean=True); mean and unbiased variance come from `moments`, which the
  caller sums over micro-batches and ranks first, so the result does not depend on how the batch was split.

Treating a completion cut by max_tokens as ended (V = 0 after it, no bootstrap) is what verl, OpenRLHF and
TRL do: the reward scored the cut text, so that text's return is the reward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def last_token(mask: Tensor) -> Tensor:
    """[B, L] bool: True at each row's last loss token (nowhere in a row without one)."""
    m = mask.to(torch.bool)
    counts = m.to(torch.int64).cumsum(-1)
    return m & (counts == counts[:, -1:])


def token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """[B, L]: each row's score ([B]) at its last loss token, minus kl_coef x kl on every loss token."""
    m = mask.to(torch.bool)
    rewards = torch.where(last_token(m), scores.to(torch.float32)[:, None], 0.0)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * torch.where(m, kl, 0.0)
    return rewards


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns), [B, L] each, 0 off the mask; the recursion runs backwards over the columns."""
    m = mask.to(torch.bool)
    rewards, values = rewards.to(torch.float32), values.to(torch.float32)
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])  # A_{t+1} of the next loss token
    next_value = torch.zeros_like(rewards[:, 0])  # V_{t+1} of the next loss token; 0 past the last
    for t in range(rewards.shape[1] - 1, -1, -1):
        here = m[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, values[:, t], next_value)
        advantages[:, t] = torch.where(here, running, 0.0)
    returns = torch.where(m, advantages + values, 0.0)
    return advantages, returns


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """[B, L] G_t = r_t + gamma G_{t+1} over the loss tokens (REINFORCE++, verl
    `compute_reinforce_plus_plus_outcome_advantage` before its whitening)."""
    return gae(rewards, torch.zeros_like(rewards, dtype=torch.float32), mask, gamma, 1.0)[0]


def moments(x: Tensor, mask: Tensor) -> Tensor:
    """[3] float64: (sum, sum of squares, count) of x over the loss tokens; summed over parts, `whiten`'s input."""
    m = mask.to(torch.bool)
    x = torch.where(m, x.to(torch.float64), 0.0)
    return torch.stack([x.sum(), x.square().sum(), m.sum().to(torch.float64)])


def whiten(x: Tensor, mask: Tensor, totals: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) on the loss tokens (0 elsewhere), mean and unbiased var from `totals`
    (`moments` of the whole batch). One token: var 0, so it becomes 0."""
    total, squares, count = (float(v) for v in totals)
    mean = total / max(count, 1.0)
    var = max(squares - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    return torch.where(mask.to(torch.bool), (x.to(torch.float32) - mean) * (var + eps) ** -0.5, 0.0)


# ---- packed micro-batches <-> rows ------------------------------------------------------------------


def loss_columns(mask: Tensor, seq_ids: Tensor, cu_seqlens: Tensor) -> Tensor:
    """[T]: each loss position's index among its sequence's loss positions (0, 1, ...); -1 off the mask.

    Rows hold loss tokens only, left-aligned, so the backward recursion runs over the longest completion,
    not the longest prompt + completion."""
    m = mask.to(torch.bool)
    seen = m.to(torch.int64).cumsum(0)
    before = torch.cat([seen.new_zeros(1), seen])[cu_seqlens[:-1].to(torch.int64)]  # loss tokens ahead of each sequence
    return torch.where(m, seen - before[seq_ids] - 1, -1)


def to_rows(x: Tensor, columns: Tensor, seq_ids: Tensor, rows: int, width: int) -> Tensor:
    """[rows, width]: packed [T] values at their (sequence, loss column); 0 where no loss token lands."""
    keep = columns >= 0
    out = x.new_zeros(rows, width)
    out[seq_ids[keep], columns[keep]] = x[keep]
    return out


def from_rows(x: Tensor, columns: Tensor, seq_ids: Tensor) -> Tensor:
    """Packed [T] from [rows, width]: each loss position's value; 0 off the mask."""
    keep = columns >= 0
    return torch.where(keep, x[seq_ids, columns.clamp(min=0)], 0.0)
