"""Per-token logprobs of the taken tokens and the policy entropy, without the [T, vocab] logits.

`chunked_logprobs` runs the LM head over chunks of positions and never writes an fp32 copy of
the logits: the log-sum-exp is taken in fp32 inside one kernel on CUDA (head_kernels.py). Backward
needs the logits again; it keeps them from forward in the model's dtype (T x vocab values, bf16 on
GPU) when they fit `keep_logits_bytes`, which saves one head matmul per position (about a tenth of a
0.5B model's FLOPs); past that it recomputes each chunk, so memory stays chunk x vocab. Both outputs
are differentiable: the entropy's gradient (the entropy bonus, `loss.entropy_coef`) is added in the
same backward pass over the logits when the loss uses it, by the torch row math (compiled on CUDA:
the Triton backward has no entropy term); a loss that uses only the logprob never pays for it.

`PolicyModel` wraps a HF causal LM so that the module FSDP2 shards at the root is the one whose
forward runs the head: its hooks gather the embedding/head parameters around the whole pass.
On CUDA, packed sequences go to a variable-length attention kernel (`streamrl_varlen`, attention.py),
never to a dense [T, T] mask.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def _head_forward(logits: Tensor, targets: Tensor, inv_temp: float) -> tuple[Tensor, Tensor, Tensor]:
    """(logprob of target, entropy, log-sum-exp) per row of [c, V] logits, all fp32.

    One max, then two sums that share exp(z - max) (entropy = lse - E_p[z]): the fused kernel reads
    each row twice. (A logsumexp followed by a separate entropy sum read it three times.)
    """
    z = logits.float() * inv_temp
    peak = z.amax(-1, keepdim=True)
    e = torch.exp(z - peak)
    total = e.sum(-1)
    lse = peak.squeeze(1) + torch.log(total)
    logprobs = z.gather(1, targets[:, None]).squeeze(1) - lse
    entropy = lse - (e * z).sum(-1) / total
    return logprobs, entropy, lse


def _head_backward(logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, inv_temp: float) -> Tensor:
    """d loss / d logits = g * (onehot(target) - softmax) / temperature, in the logits' dtype.

    The one-hot is a comparison, not a scatter: a scatter split the fused kernel in two, with an
    fp32 [c, V] intermediate written and read back between them.
    """
    z = logits.float() * inv_temp
    onehot = (torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]).to(z.dtype)
    return ((onehot - torch.exp(z - lse[:, None])) * (grad * inv_temp)[:, None]).to(logits.dtype)


def _head_backward_entropy(
    logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, grad: Tensor, grad_entropy: Tensor, inv_temp: float
) -> Tensor:
    """d loss / d logits with the entropy's term: g * (onehot - p) / T + g_H * dH/dz / T.

    H = lse - E_p[z] with z = logits / T, so dH/dz_j = -p_j (z_j - E_p[z]) = -p_j (z_j - (lse - H)):
    from the saved [c] lse and entropy, no [c, V] tensor beyond the logits themselves.
    """
    z = logits.float() * inv_temp
    p = torch.exp(z - lse[:, None])
    onehot = (torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]).to(z.dtype)
    mean_z = (lse - entropy)[:, None]
    d = (onehot - p) * grad[:, None] - p * (z - mean_z) * grad_entropy[:, None]
    return (d * inv_temp).to(logits.dtype)


_COMPILED: dict = {}
TRITON_HEAD = True  # False: the torch.compile'd row math on CUDA (the bench's before)


def _kernels(device: torch.device):
    """The row math on CUDA: head_kernels' Triton kernels (one read of each row forward), else the
    functions above fused by torch.compile (one kernel per chunk each way, two reads forward); eager
    elsewhere."""
    if device.type != "cuda":
        return _head_forward, _head_backward
    if TRITON_HEAD:
        try:
            from streamrl.learner.head_kernels import head_backward, head_forward
        except ImportError:  # no triton: the compiled path
            pass
        else:
            return head_forward, head_backward
    if not _COMPILED:
        _COMPILED["fwd"] = torch.compile(_head_forward)
        _COMPILED["bwd"] = torch.compile(_head_backward)
    return _COMPILED["fwd"], _COMPILED["bwd"]


def _entropy_kernel(device: torch.device):
    """The backward row math with the entropy term: compiled on CUDA, eager elsewhere."""
    if device.type != "cuda":
        return _head_backward_entropy
    if "bwd_entropy" not in _COMPILED:
        _COMPILED["bwd_entropy"] = torch.compile(_head_backward_entropy)
    return _COMPILED["bwd_entropy"]


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, inv_temp: float, keep: bool):
        n = hidden.shape[0]
        forward, _ = _kernels(hidden.device)
        logprobs, entropy, lse = (hidden.new_empty(n, dtype=torch.float32) for _ in range(3))
        kept = []
        for s in range(0, n, chunk):
            logits = hidden[s : s + chunk] @ weight.t()
            logprobs[s : s + chunk], entropy[s : s + chunk], lse[s : s + chunk] = forward(
                logits, targets[s : s + chunk], inv_temp
            )
            if keep:
                kept.append(logits)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, *kept)
        ctx.chunk, ctx.inv_temp = chunk, inv_temp
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: no entropy term then
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, targets, lse, entropy, *kept = ctx.saved_tensors
        chunk = ctx.chunk
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        rows = _backward_rows(hidden.device, targets, lse, entropy, grad_logprobs, grad_entropy, ctx.inv_temp)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i, s in enumerate(range(0, hidden.shape[0], chunk)):
            h = hidden[s : s + chunk]
            logits = kept[i] if kept else h @ weight.t()
            d_logits = rows(logits, slice(s, s + chunk))
            torch.mm(d_logits, weight, out=grad_hidden[s : s + chunk])  # rows of grad_hidden: no copy
            grad_weight = _accumulate(grad_weight, d_logits.t(), h)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def _backward_rows(device, targets, lse, entropy, grad, grad_entropy, inv_temp: float):
    """A function (logits of one chunk, its row slice) -> d loss / d logits: the fast kernel for the
    logprob alone, the entropy-aware row math when the entropy has a gradient too."""
    grad = grad.float()
    if grad_entropy is None:
        _, backward = _kernels(device)
        return lambda logits, rows: backward(logits, targets[rows], lse[rows], grad[rows], inv_temp)
    backward, grad_entropy = _entropy_kernel(device), grad_entropy.float()
    return lambda logits, rows: backward(
        logits, targets[rows], lse[rows], entropy[rows], grad[rows], grad_entropy[rows], inv_temp
    )


def _accumulate(total: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """total + a @ b with total fp32 and a, b in the model's dtype: on CUDA one matmul whose epilogue adds
    into fp32 (no [V, H] product in bf16 written, read back and added by a second kernel)."""
    if total.is_cuda and a.dtype != total.dtype:
        return torch.addmm(total, a, b, out_dtype=total.dtype)
    return total.add_(a @ b)


DEFAULT_KEEP_LOGITS_BYTES = 16 * 2**30
MAX_CHUNK = 8192


def head_chunk(vocab_size: int, most: int = MAX_CHUNK) -> int:
    """Positions per LM-head chunk: `most`, halved until chunk x vocab < 2**31. Past that the fused
    kernels index in 64 bits (on an H200 a 16384-position chunk of a 152k vocabulary stepped 8% slower
    than 4096, 64-bit indexing the likely cause)."""
    chunk = most
    while chunk > 1 and chunk * vocab_size >= 2**31:
        chunk //= 2
    return chunk


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk: int = 1024,
    temperature: float = 1.0,
    keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES,
) -> tuple[Tensor, Tensor]:
    """(log softmax(hidden @ weight.T / temperature)[target], entropy), both [T] fp32; hidden [T, H].

    The logits are kept for backward when T x vocab of them fit `keep_logits_bytes` (0: always recompute).
    """
    keep = hidden.shape[0] * weight.shape[0] * hidden.element_size() <= keep_logits_bytes
    return _ChunkedLogprobs.apply(hidden, weight, targets, chunk, 1.0 / temperature, keep)


class PolicyModel(nn.Module):
    """A HF causal LM whose forward maps a packed micro-batch to (logprobs, entropy) of its targets."""

    def __init__(
        self,
        lm: nn.Module,
        chunk: int = 0,
        temperature: float = 1.0,
        keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES,
    ):
        super().__init__()
        self.lm, self.temperature = lm, temperature
        head = lm.get_output_embeddings().weight
        # 0: the widest chunk that fits 32-bit indexing on CUDA; 1024 on CPU, where the eager row math
        # materialises several fp32 [chunk, vocab] temporaries
        self.chunk = chunk or head_chunk(head.shape[0], MAX_CHUNK if head.is_cuda else 1024)
        self.keep_logits_bytes = keep_logits_bytes

    @property
    def varlen(self) -> bool:
        return self.lm.config._attn_implementation == "streamrl_varlen"

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, targets: Tensor, cu_seqlens: Tensor, max_seqlen: int
    ) -> tuple[Tensor, Tensor]:
        extra = {}
        if self.varlen:
            cu = cu_seqlens.to(torch.int32)
            extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_seqlen, max_length_k=max_seqlen)
        out = self.lm.model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **extra)
        return chunked_logprobs(
            out.last_hidden_state[0],
            self.lm.get_output_embeddings().weight,
            targets,
            self.chunk,
            self.temperature,
            self.keep_logits_bytes,
        )
