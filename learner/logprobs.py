"""Per-token logprobs of the taken tokens and the policy entropy, without the [T, vocab] logits.

`chunked_logprobs` runs the LM head over chunks of positions: each chunk's logits (in fp32, for a
stable log-sum-exp) live only while that chunk is processed, forward and again in backward, so a
152k vocabulary costs chunk x vocab floats instead of T x vocab. Only the logprob is
differentiated; the entropy is a metric.

`PolicyModel` wraps a HF causal LM so that the module FSDP2 shards at the root is the one whose
forward runs the head: its hooks gather the embedding/head parameters around the whole pass.
On CUDA, packed sequences go to a variable-length flash kernel (`streamrl_varlen`), never to a
dense [T, T] mask.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, inv_temp: float):
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            logits = (hidden[s:s + chunk] @ weight.t()).float() * inv_temp  # [c, V]
            lse_c = torch.logsumexp(logits, dim=-1)
            logprobs[s:s + chunk] = logits.gather(1, targets[s:s + chunk, None]).squeeze(1) - lse_c
            probs = torch.exp(logits - lse_c[:, None])
            entropy[s:s + chunk] = lse_c - (probs * logits).sum(-1)
            lse[s:s + chunk] = lse_c
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.inv_temp = chunk, inv_temp
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor, _grad_entropy: Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, inv_temp = ctx.chunk, ctx.inv_temp
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            g = grad_logprobs[s:s + chunk].float()
            logits = (h @ weight.t()).float() * inv_temp
            # d logprob / d logits = onehot(target) - softmax
            d_logits = torch.exp(logits - lse[s:s + chunk, None]).mul_(-g[:, None])
            d_logits.scatter_add_(1, targets[s:s + chunk, None], g[:, None])
            d_logits = (d_logits * inv_temp).to(hidden.dtype)
            grad_hidden[s:s + chunk] = d_logits @ weight
            grad_weight.add_(d_logits.t() @ h)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def chunked_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = 1024,
                     temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(log softmax(hidden @ weight.T / temperature)[target], entropy), both [T] fp32; hidden [T, H]."""
    return _ChunkedLogprobs.apply(hidden, weight, targets, chunk, 1.0 / temperature)


_VARLEN: dict = {}


def _varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers attention over packed sequences with torch's varlen flash kernel ([1, H, T, D] in)."""
    cu, max_len = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    if not _VARLEN["gqa"] and k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    out = _VARLEN["fn"](q, k, v, cu, cu, max_len, max_len, scale=scaling, **_VARLEN["extra"])
    return out[None], None  # [1, T, H, D]


def register_varlen_attention() -> bool:
    """Make attn_implementation="streamrl_varlen" available; False where torch has no varlen kernel."""
    try:
        from torch.nn.attention.varlen import varlen_attn
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    params = inspect.signature(varlen_attn).parameters  # the signature moved between torch releases
    extra = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    _VARLEN.update(fn=varlen_attn, extra=extra, gqa="enable_gqa" in params)
    AttentionInterface.register("streamrl_varlen", _varlen_attention)
    AttentionMaskInterface.register("streamrl_varlen", lambda *args, **kwargs: None)
    return True


class PolicyModel(nn.Module):
    """A HF causal LM whose forward maps a packed micro-batch to (logprobs, entropy) of its targets."""

    def __init__(self, lm: nn.Module, chunk: int = 1024, temperature: float = 1.0):
        super().__init__()
        self.lm, self.chunk, self.temperature = lm, chunk, temperature

    @property
    def varlen(self) -> bool:
        return self.lm.config._attn_implementation == "streamrl_varlen"

    def forward(self, input_ids: Tensor, position_ids: Tensor, targets: Tensor, cu_seqlens: Tensor,
                max_seqlen: int) -> tuple[Tensor, Tensor]:
        extra = {}
        if self.varlen:
            cu = cu_seqlens.to(torch.int32)
            extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_seqlen, max_length_k=max_seqlen)
        out = self.lm.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **extra)
        return chunked_logprobs(out.last_hidden_state[0], self.lm.get_output_embeddings().weight, targets,
                                self.chunk, self.temperature)
