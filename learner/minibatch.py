"""A rank's micro-batches as the mini-batches of mini-batch PPO (`learner.mini_batches`).

Each mini-batch is a list of micro-batches holding whole sequences (sequence-level weights, GSPO and
sequence aggregation sum over `seq_ids` within one micro-batch), balanced by positions:
- with at least as many micro-batches as updates, whole micro-batches are dealt out (longest first to
  the lightest mini-batch: they differ by at most one micro-batch), with no device work at all;
- with fewer, the rank's sequences, in order, are cut into contiguous runs of about equal positions,
  and a micro-batch is sliced at sequence boundaries. That reads the boundaries (and each sequence's
  loss tokens, for the normaliser) to the host once per step, in one transfer; slices of contiguous
  sequences are views, so nothing is gathered.
A rank with fewer sequences than updates leaves some mini-batches empty (the trainer fills its rounds).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from streamrl.learner.batching import MicroBatch, split_by_tokens


def split_updates(micro_batches: list[MicroBatch], updates: int) -> list[list[MicroBatch]]:
    """This rank's micro-batches as `updates` mini-batches (see the module doc)."""
    if updates == 1:
        return [list(micro_batches)]
    if len(micro_batches) >= updates:
        shares = split_by_tokens([mb.num_tokens for mb in micro_batches], updates)
        return [[micro_batches[i] for i in share] for share in shares]
    return _split_sequences(micro_batches, updates)


def cut_points(costs: list[int], parts: int) -> list[int]:
    """Boundaries 0 = b_0 <= b_1 <= ... <= b_parts = len(costs) cutting the sequence of costs into
    `parts` contiguous runs: b_k is the boundary whose prefix sum is nearest k/parts of the total (the
    earlier on a tie), and no run is empty while there are at least `parts` items."""
    n, prefix = len(costs), [0, *accumulate(costs)]
    total = prefix[-1]
    cuts = [0]
    for k in range(1, parts):
        lo, hi = (cuts[-1] + 1, n - (parts - k)) if n >= parts else (cuts[-1], n)
        target = k * total / parts
        cuts.append(min(range(lo, hi + 1), key=lambda b: (abs(prefix[b] - target), b)))
    return cuts + [n]


def _split_sequences(micro_batches: list[MicroBatch], updates: int) -> list[list[MicroBatch]]:
    if not micro_batches:
        return [[] for _ in range(updates)]
    counts = [mb.cu_seqlens.numel() - 1 for mb in micro_batches]
    bounds, loss_tokens = _host_boundaries(micro_batches, counts)
    where = [(m, s) for m, count in enumerate(counts) for s in range(count)]  # (micro-batch, sequence) in order
    costs = [bounds[m][s + 1] - bounds[m][s] for m, s in where]
    cuts = cut_points(costs, updates)
    out: list[list[MicroBatch]] = []
    for a, b in zip(cuts, cuts[1:]):
        pieces: list[MicroBatch] = []
        i = a
        while i < b:  # one piece per micro-batch the run touches
            m, first = where[i]
            last = min(b, i + counts[m] - first) - 1
            pieces.append(_slice(micro_batches[m], first, where[last][1] + 1, bounds[m], loss_tokens[m]))
            i = last + 1
        out.append(pieces)
    return out


def _host_boundaries(micro_batches: list[MicroBatch], counts: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Each micro-batch's cu_seqlens and per-sequence loss tokens, read to the host in one transfer."""
    parts = []
    for mb, count in zip(micro_batches, counts):
        mask = mb.loss_mask.to(torch.int64)
        per_seq = torch.zeros_like(mask).scatter_add_(0, mb.seq_ids, mask)[:count]  # sized T: no sync to size it
        parts += [mb.cu_seqlens.to(torch.int64), per_seq]
    flat = torch.cat(parts).tolist()  # the one host sync of a split step
    bounds, tokens, at = [], [], 0
    for count in counts:
        bounds.append(flat[at : at + count + 1])
        tokens.append(flat[at + count + 1 : at + 2 * count + 1])
        at += 2 * count + 1
    return bounds, tokens


def _slice(mb: MicroBatch, first: int, end: int, cu: list[int], loss_tokens: list[int]) -> MicroBatch:
    """Sequences [first, end) of `mb` as a micro-batch of their own (views of its tensors)."""
    if first == 0 and end == len(cu) - 1:
        return mb
    lo, hi = cu[first], cu[end]
    span = slice(lo, hi)
    tokens = loss_tokens[first:end]
    return MicroBatch(
        input_ids=mb.input_ids[span],
        position_ids=mb.position_ids[span],
        targets=mb.targets[span],
        loss_mask=mb.loss_mask[span],
        behavior_logprobs=mb.behavior_logprobs[span],
        advantages=mb.advantages[span],
        versions=mb.versions[span],
        seq_ids=mb.seq_ids[span] - first,
        cu_seqlens=mb.cu_seqlens[first : end + 1] - lo,
        max_seqlen=max(b - a for a, b in zip(cu[first:end], cu[first + 1 : end + 1])),
        sample_ids=mb.sample_ids[first:end],
        loss_tokens=sum(tokens),
        loss_sequences=sum(1 for t in tokens if t),
    )
