"""Group-relative advantages: every completion is scored against the other completions of its prompt.

No critic: a group of N completions of one prompt is its own baseline. Groups whose rewards are
all equal carry no signal (every advantage is 0); they are counted so the caller can warn. `batch_std`
keeps the group's mean as the baseline but scales by the spread of the whole step's rewards (TRL
`scale_rewards="batch"`, after PPO-Lite): a group of nearly equal rewards is not blown up to unit scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Kind = Literal["group_mean", "group_std", "leave_one_out", "batch_std"]
KINDS = ("group_mean", "group_std", "leave_one_out", "batch_std")


def _one_group(rewards: Tensor, kind: Kind, eps: float) -> tuple[Tensor, bool]:
    n = rewards.numel()
    flat = (rewards.max() - rewards.min()).item() <= eps if n else True
    if flat or n < 2:
        return torch.zeros_like(rewards), True
    centered = rewards - rewards.mean()
    if kind in ("group_mean", "batch_std"):  # batch_std: divided by the batch's std afterwards
        return centered, False
    if kind == "group_std":
        # unbiased std, as GRPO (and TRL/verl) compute it; eps keeps near-flat groups finite
        return centered / (rewards.std() + eps), False
    # r_i - mean_{j != i} r_j  ==  n / (n - 1) * (r_i - mean)
    return centered * (n / (n - 1)), False


def group_advantages(
    rewards: Tensor | Sequence[Sequence[float]], kind: Kind = "group_std", eps: float = 1e-6
) -> tuple[Tensor | list[list[float]], int]:
    """Advantages of each sample relative to its group, and how many groups had zero reward variance.

    `rewards` is a [G, N] tensor (G groups of N samples) or a list of groups of any sizes; the
    result has the same form. kind: `group_mean` (r - mean), `group_std` ((r - mean) / (std + eps),
    GRPO), `leave_one_out` (r - mean of the others, RLOO), `batch_std` ((r - mean of its group) /
    (std of every reward given + eps), both std unbiased as TRL's). A group of one sample, or whose rewards
    differ by at most eps, gets all-zero advantages and counts as zero-variance.
    """
    if kind not in KINDS:
        raise ValueError(f"advantage kind {kind!r} is unknown; use one of {', '.join(KINDS)} (loss.advantage)")
    if isinstance(rewards, Tensor):
        if rewards.dim() != 2:
            raise ValueError(f"rewards tensor must be [groups, samples], got shape {tuple(rewards.shape)}")
        rows = [_one_group(row, kind, eps) for row in rewards.to(torch.float64)]
        scale = _batch_scale(list(rewards.to(torch.float64)), kind, eps)
        out = torch.stack([a / scale for a, _ in rows]).to(rewards.dtype) if rows else rewards.clone()
        return out, sum(flat for _, flat in rows)
    tensors = [torch.tensor(list(g), dtype=torch.float64) for g in rewards]
    groups, scale = [_one_group(g, kind, eps) for g in tensors], _batch_scale(tensors, kind, eps)
    return [(a / scale).tolist() for a, _ in groups], sum(flat for _, flat in groups)


def _batch_scale(groups: list[Tensor], kind: Kind, eps: float) -> float:
    """batch_std's divisor: the unbiased std of every reward of the step, + eps; 1 for the other kinds."""
    if kind != "batch_std":
        return 1.0
    every = torch.cat([g.reshape(-1) for g in groups]) if groups else torch.zeros(0, dtype=torch.float64)
    return (every.std().item() if every.numel() > 1 else 0.0) + eps
