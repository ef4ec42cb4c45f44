"""Per-token logprobs of the taken tokens and the policy entropy, without the [T, vocab] logits.

`chunked_logprobs` runs the LM head over chunks of positions and never writes an fp32 copy of
the logits: the log-sum-exp is taken in fp32 inside one kernel on CUDA (head_kernels.py). Backward
needs the logits again; it keeps them from forward in the model's dtype (T x vocab values, bf16 on
GPU) when they fit `keep_logits_bytes`, which saves one head matmul per position (about a tenth of a
0.5B model's FLOPs); past that it recomputes each chunk, so memory stays chunk x vocab. Both outputs
are differentiable: the entropy's gradient (the entropy bonus, `loss.entropy_coef`) is added in the
same backward pass over the logits when the loss uses it, by the torch row math (compiled on CUDA:
the Triton backward has no entropy term); a loss that uses only the logprob never pays for it.

The distribution is the one the rollout engines sample from: logits / temperature, and with top-k/top-p
the softmax over the kept tokens only (engine/sampling.py), so pi_theta and the behaviour logprobs mu are
of one distribution; the kept set is a per-row floor on the scaled logits, found in forward (one sort per
chunk with top-p) and kept for backward. The Triton kernels have no floor: with top-k/top-p the torch
row math runs (compiled on CUDA).

`PolicyModel` wraps a HF causal LM so that the module FSDP2 shards at the root is the one whose
forward runs the head: its hooks gather the embedding/head parameters around the whole pass.
On CUDA, packed sequences go to a variable-length attention kernel (`streamrl_varlen`, attention.py),
never to a dense [T, T] mask.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streamrl.engine.sampling import filtered, filters, keep_floor


def _head_forward(
    logits: Tensor, targets: Tensor, inv_temp: float, floor: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(logprob of target, entropy, log-sum-exp) per row of [c, V] logits, all fp32.

    One max, then two sums that share exp(z - max) (entropy = lse - E_p[z]): the fused kernel reads
    each row twice. (A logsumexp followed by a separate entropy sum read it three times.) With `floor`
    ([c], top-k/top-p sampling) the distribution is the one sampled from: the tokens below the floor are
    out of it, the rest renormalised (engine/sampling.py).
    """
    z = logits.float() * inv_temp
    kept = z if floor is None else filtered(z, floor)
    peak = kept.amax(-1, keepdim=True)
    e = torch.exp(kept - peak)
    total = e.sum(-1)
    lse = peak.squeeze(1) + torch.log(total)
    logprobs = z.gather(1, targets[:, None]).squeeze(1) - lse
    entropy = lse - (e * z).sum(-1) / total
    return logprobs, entropy, lse


def _head_backward(
    logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor, inv_temp: float, floor: Tensor | None = None
) -> Tensor:
    """d loss / d logits = g * (onehot(target) - softmax) / temperature, in the logits' dtype (the softmax
    over the kept tokens with `floor`: the filter itself is piecewise constant, so it has no gradient).

    The one-hot is a comparison, not a scatter: a scatter split the fused kernel in two, with an
    fp32 [c, V] intermediate written and read back between them.
    """
    z = logits.float() * inv_temp
    kept = z if floor is None else filtered(z, floor)
    onehot = (torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]).to(z.dtype)
    return ((onehot - torch.exp(kept - lse[:, None])) * (grad * inv_temp)[:, None]).to(logits.dtype)


def _head_backward_entropy(
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad: Tensor,
    grad_entropy: Tensor,
    inv_temp: float,
    floor: Tensor | None = None,
) -> Tensor:
    """d loss / d logits with the entropy's term: g * (onehot - p) / T + g_H * dH/dz / T.

    H = lse - E_p[z] with z = logits / T, so dH/dz_j = -p_j (z_j - E_p[z]) = -p_j (z_j - (lse - H)):
    from the saved [c] lse and entropy, no [c, V] tensor beyond the logits themselves.
    """
    z = logits.float() * inv_temp
    p = torch.exp((z if floor is None else filtered(z, floor)) - lse[:, None])
    onehot = (torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]).to(z.dtype)
    mean_z = (lse - entropy)[:, None]
    d = (onehot - p) * grad[:, None] - p * (z - mean_z) * grad_entropy[:, None]
    return (d * inv_temp).to(logits.dtype)


_COMPILED: dict = {}
TRITON_HEAD = True  # False: the torch.compile'd row math on CUDA (the bench's before)


def _kernels(device: torch.device, filtering: bool = False):
    """The row math on CUDA: head_kernels' Triton kernels (one read of each row forward; they have no
    top-k/top-p floor), else the functions above fused by torch.compile (one kernel per chunk each way,
    two reads forward); eager elsewhere."""
    if device.type != "cuda":
        return _head_forward, _head_backward
    if TRITON_HEAD and not filtering:
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
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, inv_temp: float, keep: bool, sampling
    ):
        """sampling: (top_k, top_p) of the rollout engines; (0, 1.0) for plain temperature sampling."""
        n = hidden.shape[0]
        filtering = filters(*sampling)
        forward, _ = _kernels(hidden.device, filtering)
        logprobs, entropy, lse = (hidden.new_empty(n, dtype=torch.float32) for _ in range(3))
        floors = hidden.new_empty(n if filtering else 0, dtype=torch.float32)  # kept for backward: no re-sort
        kept = []
        for s in range(0, n, chunk):
            logits = hidden[s : s + chunk] @ weight.t()
            extra = ()
            if filtering:
                floors[s : s + chunk] = keep_floor(logits.float() * inv_temp, *sampling)
                extra = (floors[s : s + chunk],)
            logprobs[s : s + chunk], entropy[s : s + chunk], lse[s : s + chunk] = forward(
                logits, targets[s : s + chunk], inv_temp, *extra
            )
            if keep:
                kept.append(logits)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, floors, *kept)
        ctx.chunk, ctx.inv_temp, ctx.filtering = chunk, inv_temp, filtering
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None: no entropy term then
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, targets, lse, entropy, floors, *kept = ctx.saved_tensors
        chunk = ctx.chunk
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        rows = _backward_rows(
            hidden.device,
            targets,
            lse,
            entropy,
            grad_logprobs,
            grad_entropy,
            ctx.inv_temp,
            floors if ctx.filtering else None,
        )
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i, s in enumerate(range(0, hidden.shape[0], chunk)):
            h = hidden[s : s + chunk]
            logits = kept[i] if kept else h @ weight.t()
            d_logits = rows(logits, slice(s, s + chunk))
            torch.mm(d_logits, weight, out=grad_hidden[s : s + chunk])  # rows of grad_hidden: no copy
            grad_weight = _accumulate(grad_weight, d_logits.t(), h)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def _backward_rows(device, targets, lse, entropy, grad, grad_entropy, inv_temp: float, floors: Tensor | None):
    """A function (logits of one chunk, its row slice) -> d loss / d logits: the fast kernel for the
    logprob alone, the entropy-aware row math when the entropy has a gradient too."""
    grad = grad.float()

    def floor(rows: slice) -> tuple:
        return () if floors is None else (floors[rows],)

    if grad_entropy is None:
        _, backward = _kernels(device, floors is not None)
        return lambda logits, rows: backward(logits, targets[rows], lse[rows], grad[rows], inv_temp, *floor(rows))
    backward, grad_entropy = _entropy_kernel(device), grad_entropy.float()
    return lambda logits, rows: backward(
        logits, targets[rows], lse[rows], entropy[rows], grad[rows], grad_entropy[rows], inv_temp, *floor(rows)
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
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(log softmax(hidden @ weight.T / temperature)[target], entropy), both [T] fp32; hidden [T, H].

    With top_k / top_p, of the distribution sampled from (engine/sampling.py): the softmax and the entropy
    over the kept tokens. A target outside them (the weights moved since the sample was drawn) gets its
    logit against the kept tokens' log-sum-exp: finite, below every kept token's, with the gradient of a
    kept one, where its processed probability is 0 (an importance ratio of 0, and -inf through every sum).
    The logits are kept for backward when T x vocab of them fit `keep_logits_bytes` (0: always recompute).
    """
    keep = hidden.shape[0] * weight.shape[0] * hidden.element_size() <= keep_logits_bytes
    return _ChunkedLogprobs.apply(hidden, weight, targets, chunk, 1.0 / temperature, keep, (top_k, top_p))


class PolicyModel(nn.Module):
    """A HF causal LM whose forward maps a packed micro-batch to (logprobs, entropy) of its targets."""

    def __init__(
        self,
        lm: nn.Module,
        chunk: int = 0,
        temperature: float = 1.0,
        keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES,
        top_k: int = 0,
        top_p: float = 1.0,
    ):
        """temperature, top_k, top_p: the rollout engines' sampling (rollout.*), whose distribution the
        logprobs are of."""
        super().__init__()
        self.lm, self.temperature, self.top_k, self.top_p = lm, temperature, top_k, top_p
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
            self.top_k,
            self.top_p,
        )
