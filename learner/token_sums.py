"""Per-sequence reductions over packed [T] token tensors, indexed by `seq_ids` (sequence ids from 0, one
per token; None: all one sequence). The losses, the surrogates and rejection all reduce this way, so a
sequence must sit inside one call (batching.py never splits one across micro-batches).

Results are sized T (sequence ids < positions), zeros past the last sequence: sizing them by
max(seq_ids), as bincount does, is a host sync per micro-batch on CUDA.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def sequence_sums(values: Tensor, mask: Tensor, seq_ids: Tensor | None) -> Tensor:
    """Sum of `values` over each sequence's loss tokens, indexed by sequence id (sized T; [1] if None)."""
    masked = torch.where(mask.to(torch.bool), values, torch.zeros_like(values))
    if seq_ids is None:
        return masked.sum().reshape(1)
    return torch.zeros_like(masked).scatter_add_(0, seq_ids, masked)


def sequence_lengths(mask: Tensor, seq_ids: Tensor | None) -> Tensor:
    """Loss tokens of each sequence (sized like `sequence_sums`)."""
    return sequence_sums(torch.ones_like(mask, dtype=torch.float32), mask, seq_ids)


def sequence_means(values: Tensor, mask: Tensor, seq_ids: Tensor | None) -> Tensor:
    """Mean of `values` over each sequence's loss tokens (0 for a sequence without one)."""
    return sequence_sums(values, mask, seq_ids) / sequence_lengths(mask, seq_ids).clamp(min=1.0).to(values.dtype)


def sequence_maxes(values: Tensor, mask: Tensor, seq_ids: Tensor | None) -> Tensor:
    """Largest of `values` over each sequence's loss tokens (-inf for a sequence without one)."""
    masked = torch.where(mask.to(torch.bool), values, torch.full_like(values, -math.inf))
    if seq_ids is None:
        return masked.max().reshape(1)
    return torch.full_like(masked, -math.inf).scatter_reduce_(0, seq_ids, masked, reduce="amax")


def per_token(per_sequence: Tensor, seq_ids: Tensor | None, like: Tensor) -> Tensor:
    """Each token's value of its sequence ([T], from `sequence_sums`-shaped `per_sequence`)."""
    return per_sequence[seq_ids] if seq_ids is not None else per_sequence.expand_as(like)
