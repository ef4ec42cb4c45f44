"""Trajectories (wire lists) -> packed micro-batches (tensors), once, in one place.

A sequence is prompt + completion. The model reads tokens 0..L-2 and predicts 1..L-1, so a
sequence of L tokens costs L - 1 positions of the token budget. Sequences are packed end to end
without padding; `position_ids` restart at 0 for each one, which is how the attention (sdpa's
packed-sequence mask on CPU, a varlen kernel on GPU) keeps them apart. Prompt tokens are context
only: the loss mask covers the positions that predict completion tokens (in a multi-turn episode
only the model's: `Trajectory.loss_mask`), and the behavior logprobs, advantages and versions sit
at those positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor

from streamrl.engine.messages import Trajectory


@dataclass
class MicroBatch:
    """One packed micro-batch: T positions, S sequences."""

    input_ids: Tensor  # [T] int64, the tokens the model reads
    position_ids: Tensor  # [T] int64, restarting at 0 per sequence
    targets: Tensor  # [T] int64, the next token at each position (what logprobs are of)
    loss_mask: Tensor  # [T] bool, True where the target is a completion token
    behavior_logprobs: Tensor  # [T] float32, log mu(target); 0 off the mask
    advantages: Tensor  # [T] float32, the sequence's advantage on its loss positions
    versions: Tensor  # [T] int64, policy version that sampled the target; -1 off the mask
    seq_ids: Tensor  # [T] int64, index of the sequence (0..S-1) each position belongs to
    cu_seqlens: Tensor  # [S + 1] int32, cumulative sequence lengths (varlen attention)
    max_seqlen: int
    sample_ids: list[str] = field(default_factory=list)  # [S]
    # counted on the host when packed, so the step's normaliser needs no tensor op (None: count the mask)
    loss_tokens: int | None = None
    loss_sequences: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return MicroBatch(**moved)


@dataclass
class StepBatch:
    """One rank's share of an optimizer step, as rank 0's orchestrator made it."""

    micro_batches: list[MicroBatch]
    version: int  # the policy version the step starts from
    loss_tokens: int  # loss tokens of the whole step over every rank (the token normaliser)


def sequence_cost(trajectory: Trajectory) -> int:
    """Positions the trajectory takes in a micro-batch."""
    return len(trajectory.prompt_ids) + len(trajectory.completion_ids) - 1


def plan(costs: list[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing bins of indices whose costs sum to at most `token_budget` (ties by index)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        slot = next((b for b, free in enumerate(room) if free >= costs[i]), None)
        if slot is None:
            bins.append([])
            room.append(token_budget)
            slot = len(bins) - 1
        bins[slot].append(i)
        room[slot] -= costs[i]
    return [sorted(b) for b in bins]


def _tensors(trajectory: Trajectory, advantage: float) -> dict[str, Tensor]:
    prompt, completion = trajectory.prompt_ids, trajectory.completion_ids
    tokens = torch.tensor(prompt + completion, dtype=torch.int64)
    n = tokens.numel() - 1
    start = len(prompt) - 1  # position that predicts the first completion token
    mask = torch.zeros(n, dtype=torch.bool)
    # multi-turn: environment tokens inside the completion are context, like the prompt
    mask[start:] = torch.tensor(trajectory.loss_mask, dtype=torch.bool) if trajectory.loss_mask else True
    behavior = torch.zeros(n, dtype=torch.float32)
    behavior[start:] = torch.tensor(trajectory.behavior_logprobs, dtype=torch.float32)
    versions = torch.full((n,), -1, dtype=torch.int64)
    versions[start:] = (
        torch.tensor(trajectory.token_versions, dtype=torch.int64)
        if trajectory.token_versions
        else trajectory.policy_version
    )
    if trajectory.loss_mask:
        behavior.masked_fill_(~mask, 0.0)
        versions.masked_fill_(~mask, -1)
    return {
        "input_ids": tokens[:-1],
        "targets": tokens[1:],
        "position_ids": torch.arange(n),
        "loss_mask": mask,
        "behavior_logprobs": behavior,
        "versions": versions,
        "advantages": mask.to(torch.float32) * float(advantage),
    }


def _padding(n: int) -> dict[str, Tensor]:
    """A sequence of n positions with no loss token (fills a micro-batch up to a fixed size)."""
    zeros = torch.zeros(n, dtype=torch.int64)
    return {
        "input_ids": zeros,
        "targets": zeros,
        "position_ids": torch.arange(n),
        "loss_mask": torch.zeros(n, dtype=torch.bool),
        "behavior_logprobs": torch.zeros(n),
        "versions": zeros - 1,
        "advantages": torch.zeros(n),
    }


def collate(trajectories: list[Trajectory], advantages: list[float], pad_to: int = 0) -> MicroBatch:
    """Pack the given trajectories end to end into one micro-batch (padded with one loss-free
    sequence up to `pad_to` positions, if given)."""
    parts = [_tensors(t, a) for t, a in zip(trajectories, advantages)]
    used = sum(p["input_ids"].numel() for p in parts)
    if pad_to > used:
        parts.append(_padding(pad_to - used))
    return _join(
        parts,
        sample_ids=[t.sample_id for t in trajectories],
        loss_tokens=sum(t.model_tokens for t in trajectories),
        loss_sequences=sum(1 for t in trajectories if t.model_tokens),
    )


def loss_free(positions: int, sequences: int) -> MicroBatch:
    """A micro-batch of `positions` positions in `sequences` sequences, none with a loss token: the
    shapes a compiled step will meet, without data (Trainer.warm_up)."""
    if not 1 <= sequences <= positions:
        raise ValueError(f"{sequences} sequences cannot cut {positions} positions")
    sizes = [positions // sequences] * (sequences - 1)
    return _join([_padding(n) for n in [*sizes, positions - sum(sizes)]], loss_tokens=0, loss_sequences=0)


def _join(parts: list[dict[str, Tensor]], **extra) -> MicroBatch:
    """Sequences' tensors end to end, with the offsets the attention cuts them by."""
    lengths = [p["input_ids"].numel() for p in parts]
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    seq_ids = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor(lengths))
    cu = torch.zeros(len(parts) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return MicroBatch(seq_ids=seq_ids, cu_seqlens=cu, max_seqlen=max(lengths), **cat, **extra)


def pack(
    trajectories: list[Trajectory],
    advantages: list[float],
    token_budget: int,
    pad_to_budget: bool = False,
    pad_multiple: int = 0,
) -> list[MicroBatch]:
    """Packed micro-batches of at most `token_budget` positions each; completion-less samples are skipped.

    pad_to_budget: every micro-batch gets exactly `token_budget` positions (static shapes for
    torch.compile), the rest filled by a loss-free padding sequence. pad_multiple: each micro-batch
    is padded up to a multiple of this instead (a few bucketed shapes, less padding).

    Raises ValueError naming `learner.micro_batch_tokens` when one sequence alone exceeds the budget.
    """
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages; give one each")
    keep = [i for i, t in enumerate(trajectories) if t.completion_ids]
    costs = [sequence_cost(trajectories[i]) for i in keep]
    for i, cost in zip(keep, costs):
        if cost > token_budget:
            raise ValueError(
                f"sample {trajectories[i].sample_id} needs {cost} positions (prompt + completion - 1) "
                f"but learner.micro_batch_tokens = {token_budget}; raise it to at least {cost} "
                "or lower model.max_model_len"
            )
    bins = plan(costs, token_budget)
    if pad_to_budget:
        pads = [token_budget] * len(bins)
    elif pad_multiple:
        pads = [min(token_budget, -(-sum(costs[j] for j in b) // pad_multiple) * pad_multiple) for b in bins]
    else:
        pads = [0] * len(bins)
    return [
        collate([trajectories[keep[j]] for j in b], [advantages[keep[j]] for j in b], pad) for b, pad in zip(bins, pads)
    ]


def split_by_tokens(costs: list[int], ranks: int) -> list[list[int]]:
    """Indices dealt to `ranks` ranks so their token totals differ by at most the largest single cost.

    Longest first, each to the rank with the fewest tokens so far (LPT): when a rank takes an item it
    had the least, so no rank ends more than one item's cost above another. Each rank's indices
    come back in their original order.
    """
    if ranks < 1:
        raise ValueError(f"ranks = {ranks}: must be >= 1")
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        shares[r].append(i)
        loads[r] += costs[i]
    return [sorted(s) for s in shares]


def pack_for_ranks(
    trajectories: list[Trajectory],
    advantages: list[float],
    ranks: int,
    token_budget: int,
    pad_to_budget: bool = False,
    pad_multiple: int = 0,
) -> list[list[MicroBatch]]:
    """Each rank's packed micro-batches, the samples split between ranks by tokens (`split_by_tokens`)."""
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages; give one each")
    shares = split_by_tokens([sequence_cost(t) for t in trajectories], ranks)
    return [
        pack(
            [trajectories[i] for i in share], [advantages[i] for i in share], token_budget, pad_to_budget, pad_multiple
        )
        for share in shares
    ]
