"""The step's micro-batches from rank 0 to every rank, as a few flat tensors over the learner's process group
(tensors only, no pickle): rank 0 packs every rank's share (learner/admission.py), each rank trains its own."""

from __future__ import annotations

import torch
import torch.distributed as dist

from streamrl.learner.batching import MicroBatch, StepBatch
from streamrl.learner.parallel import is_rank0, world_size

_INT_FIELDS = ("input_ids", "position_ids", "targets", "versions", "seq_ids", "loss_mask")  # [T] each
_FLOAT_FIELDS = ("behavior_logprobs", "advantages")  # [T] each
_MB_HEADER = 5  # T, S, max_seqlen, loss_tokens, loss_sequences (-1: not counted)


def scatter_step(per_rank: list[StepBatch] | None, device: torch.device) -> StepBatch:
    """This rank's share of the step: rank 0 passes every rank's `StepBatch` (the others None) and
    sends each its own as a few flat tensors over the learner's process group; every rank gets its
    micro-batches on `device`."""
    if is_rank0():
        for r in range(1, world_size()):
            _send_step(per_rank[r], r, device)
        mine = per_rank[0]
        return StepBatch([mb.to(device) for mb in mine.micro_batches], mine.version, mine.loss_tokens)
    return _recv_step(device)


def _send_step(batch: StepBatch, dst: int, device: torch.device) -> None:
    header = [batch.version, batch.loss_tokens, len(batch.micro_batches)]
    for mb in batch.micro_batches:
        header += [mb.num_tokens, mb.cu_seqlens.numel() - 1, mb.max_seqlen]
        header += [
            -1 if mb.loss_tokens is None else mb.loss_tokens,
            -1 if mb.loss_sequences is None else mb.loss_sequences,
        ]
    size = torch.tensor([len(header)], dtype=torch.int64, device=device)
    dist.send(size, dst)
    dist.send(torch.tensor(header, dtype=torch.int64, device=device), dst)
    for mb in batch.micro_batches:
        dist.send(torch.stack([getattr(mb, f).to(torch.int64) for f in _INT_FIELDS]).to(device), dst)
        dist.send(torch.stack([getattr(mb, f).to(torch.float32) for f in _FLOAT_FIELDS]).to(device), dst)
        dist.send(mb.cu_seqlens.to(device), dst)


def _recv_step(device: torch.device) -> StepBatch:
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, 0)
    header = torch.empty(int(size.item()), dtype=torch.int64, device=device)
    dist.recv(header, 0)
    version, loss_tokens, count, *rest = header.tolist()
    micro_batches = []
    for i in range(count):
        tokens, seqs, max_seqlen, loss_toks, loss_seqs = rest[i * _MB_HEADER : (i + 1) * _MB_HEADER]
        ints = torch.empty(len(_INT_FIELDS), tokens, dtype=torch.int64, device=device)
        floats = torch.empty(len(_FLOAT_FIELDS), tokens, dtype=torch.float32, device=device)
        cu = torch.empty(seqs + 1, dtype=torch.int32, device=device)
        for t in (ints, floats, cu):
            dist.recv(t, 0)
        fields = dict(zip(_INT_FIELDS, ints)) | dict(zip(_FLOAT_FIELDS, floats))
        fields["loss_mask"] = fields["loss_mask"].to(torch.bool)
        micro_batches.append(
            MicroBatch(
                **fields,
                cu_seqlens=cu,
                max_seqlen=max_seqlen,
                loss_tokens=None if loss_toks < 0 else loss_toks,
                loss_sequences=None if loss_seqs < 0 else loss_seqs,
            )
        )
    return StepBatch(micro_batches, version, loss_tokens)
