"""The distribution a rollout engine samples from: logits / temperature, filtered by top-k then top-p.

Every role computes it the same way: the rollout backends report each sampled token's log-probability
under it (vLLM's `logprobs_mode="processed_logprobs"`, the hf backend's processed scores), and the learner
recomputes the same from its logits (learner/logprobs.py), so the importance weight pi / mu compares
like with like. With neither filter on it is log_softmax(logits / T).

The filters as vLLM (`apply_top_k_top_p`, torch path) and transformers (`TopKLogitsWarper`,
`TopPLogitsWarper`) apply them: top-k keeps the logits >= the k-th largest (ties at the k-th are kept);
top-p sorts ascending, drops the prefix whose cumulative probability (over what top-k kept) is <= 1 - p,
always keeping the likeliest token; the kept tokens are renormalised. The kept set is therefore every
token whose scaled logit is >= a per-row floor (`keep_floor`), which is all the learner needs to keep
between forward and backward. (A tie exactly at the top-p boundary is the one case where a sort could keep
one of two equal logits; the floor keeps both.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def filters(top_k: int, top_p: float) -> bool:
    """Whether sampling truncates the distribution at all."""
    return top_k > 0 or top_p < 1.0


def keep_floor(z: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Per row of scaled logits z [c, V] the smallest kept value: token v is sampled from iff z[v] >= floor."""
    floor = torch.full(z.shape[:1], -math.inf, dtype=z.dtype, device=z.device)
    if 0 < top_k < z.shape[-1]:
        floor = torch.topk(z, top_k, dim=-1).values[:, -1]
    if top_p < 1.0:
        ascending = z.sort(dim=-1).values
        ascending = torch.where(ascending < floor[:, None], -math.inf, ascending)  # top-k first, as vLLM
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        # 1 - p in the logits' dtype, as vLLM forms it from its p tensor
        dropped = cumulative <= 1 - torch.tensor(top_p, dtype=z.dtype, device=z.device)
        dropped[:, -1] = False  # the likeliest token always stays
        floor = ascending.gather(1, dropped.sum(-1, keepdim=True)).squeeze(1)  # dropped tokens are a prefix
    return floor


def filtered(z: Tensor, floor: Tensor) -> Tensor:
    """z with every token below its row's floor at -inf."""
    return torch.where(z >= floor[:, None], z, -math.inf)


def processed_logprobs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """log-probabilities [c, V] (fp32) of the distribution sampled from: -inf on the tokens filtered out."""
    z = logits.float() / temperature
    if filters(top_k, top_p):
        z = filtered(z, keep_floor(z, top_k, top_p))
    return z.log_softmax(-1)
