"""Attention over packed sequences on CUDA: one [T, H, D] stream cut by cumulative offsets, never a [T, T] mask.

transformers calls `streamrl_varlen` (registered here) with the micro-batch's `cu_seqlens`; it runs torch's
variable-length flash kernel (FA2, `torch.nn.attention.varlen.varlen_attn`).

No mask function is registered for it: transformers then skips mask preparation altogether. With one
registered (even one returning None) it first scanned `position_ids` for packed sequences and read the
answer on the host, a GPU sync at the start of every forward.

cuDNN's ragged attention (`aten._cudnn_attention_forward` with `cum_seq` offsets) was measured as the
alternative on an H200 with torch 2.11 and is not used: 60x slower than flash there, wrong gradients,
and an illegal memory access for unpadded offsets (bench/attention_kernels.py, bench/RESULTS.md).
"""

from __future__ import annotations

import functools
import inspect

from torch import Tensor


@functools.cache
def _causal_kwargs() -> dict:
    """varlen_attn's keywords for causal (and grouped-query) attention: its signature moved between torch
    releases. Read once, not per call."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    extra = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        extra["enable_gqa"] = True
    return extra


def flash_attention(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float) -> Tensor:
    """Causal attention of packed q [T, Hq, D], k/v [T, Hkv, D]; [T, Hq, D] out."""
    from torch.nn.attention.varlen import varlen_attn

    extra = _causal_kwargs()
    if "enable_gqa" not in extra and k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **extra)


def _varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention interface: [1, H, T, D] in, [1, T, H, D] out."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = flash_attention(q, k, v, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], scale)
    return out[None], None


def register_varlen_attention() -> bool:
    """Make attn_implementation="streamrl_varlen" available; False where torch has no varlen kernel."""
    try:
        import torch.nn.attention.varlen  # noqa: F401
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register("streamrl_varlen", _varlen_attention)
    return True
