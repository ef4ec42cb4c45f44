"""Packed causal attention, flash (FA2, what the learner runs) vs cuDNN's ragged SDPA, on the Qwen2-0.5B
attention shape; JSON lines. cuDNN is wrapped here, not in the learner: on torch 2.11 it was 60x slower
than flash with wrong gradients (bench/RESULTS.md); rerun this on a newer torch before trying it again.

    python bench/attention_kernels.py            # ~64k tokens of 1024-2048-token sequences, 14 q / 2 kv heads, d 64

Per kernel: forward and forward+backward milliseconds (median of --steps), attention TFLOP/s (causal:
forward 2*Hq*D*sum(L^2), backward 2.5x that), the first call's milliseconds (cuDNN builds its plan then),
the first call on a new packing (other sequence count and longest length: a plan per shape unless the
offsets are bucketed), and the largest difference from flash in the output and in dq/dk/dv.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from streamrl.learner.attention import flash_attention


@torch.library.custom_op("streamrl_bench::cudnn_varlen", mutates_args=())
def cudnn_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's ragged SDPA on packed [T, H, D]: (out, logsumexp [T, Hq, 1] fp32)."""
    res = torch.ops.aten._cudnn_attention_forward(
        q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False, scale=scale
    )
    lse = res[1].unsqueeze(-1) if res[1].dim() == 2 else res[1]
    return res[0], lse.reshape(q.shape[0], q.shape[1], 1)


def _cudnn_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu = ctx.saved_tensors
    philox = torch.zeros(1, dtype=torch.int64, device=q.device)  # read only with dropout
    dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
        grad_out.contiguous(),
        q,
        k,
        v,
        out,
        lse,
        philox,
        philox,
        None,
        cu,
        cu,
        ctx.max_len,
        ctx.max_len,
        0.0,
        True,
        scale=ctx.scale,
    )
    return dq, dk, dv, None, None, None


def _cudnn_setup(ctx, inputs, output):
    q, k, v, cu, max_len, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu)
    ctx.max_len, ctx.scale = max_len, scale


cudnn_varlen.register_autograd(_cudnn_backward, setup_context=_cudnn_setup)


def cudnn_attention(q, k, v, cu, max_len, scale, seq_bucket=16, len_bucket=256):
    """Offsets padded with empty sequences to a multiple of `seq_bucket`, the longest length rounded up:
    fewer shapes, so fewer cuDNN plans."""
    pad = -(cu.shape[0] - 1) % seq_bucket
    if pad:
        cu = torch.cat([cu, cu[-1:].expand(pad)])
    max_len = -(-max_len // len_bucket) * len_bucket
    return cudnn_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, max_len, scale)[0]


def cudnn_unbucketed(q, k, v, cu, max_len, scale):
    """cuDNN with the packing's own shape: one plan per sequence count and longest length."""
    return cudnn_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu, max_len, scale)[0]


KERNELS = {"flash": flash_attention, "cudnn": cudnn_attention, "cudnn_unbucketed": cudnn_unbucketed}


def packing(seed: int, tokens: int, shortest: int, longest: int) -> list[int]:
    rng, lengths = random.Random(seed), []
    while sum(lengths) < tokens - longest:
        lengths.append(rng.randint(shortest, longest))
    return lengths


def inputs(lengths, heads, kv_heads, dim, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    qkv = [
        torch.randn(total, h, dim, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
        for h in (heads, kv_heads, kv_heads)
    ]
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    return qkv, cu


def ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run(name, lengths, args):
    kernel = KERNELS[name]
    (q, k, v), cu = inputs(lengths, args.heads, args.kv_heads, args.dim)
    scale, longest = args.dim**-0.5, max(lengths)
    grad = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            return kernel(q, k, v, cu, longest, scale)

    def both():
        out = kernel(q, k, v, cu, longest, scale)
        out.backward(grad)
        return out

    first = ms(both, 1)
    out = both()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    other = packing(args.seed + 1, args.tokens, args.shortest, args.longest)
    (q2, k2, v2), cu2 = inputs(other, args.heads, args.kv_heads, args.dim, seed=1)
    new_shape = ms(lambda: kernel(q2, k2, v2, cu2, max(other), scale).sum().backward(), 1)
    fwd, fwd_bwd = ms(forward, args.steps), ms(both, args.steps)
    flops = 2 * args.heads * args.dim * sum(n * n for n in lengths)  # one layer
    return (
        dict(
            kernel=name,
            fwd_ms=round(fwd, 3),
            fwd_bwd_ms=round(fwd_bwd, 3),
            fwd_tflops=round(flops / fwd / 1e9, 1),
            fwd_bwd_tflops=round(3.5 * flops / fwd_bwd / 1e9, 1),
            first_call_ms=round(first, 1),
            new_packing_first_call_ms=round(new_shape, 1),
            tokens=sum(lengths),
            sequences=len(lengths),
        ),
        out.detach(),
        grads,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--shortest", type=int, default=1024)
    ap.add_argument("--longest", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", default="flash,cudnn,cudnn_unbucketed")
    args = ap.parse_args()
    lengths = packing(args.seed, args.tokens, args.shortest, args.longest)
    ref = None
    for name in args.kernels.split(","):
        try:
            fields, out, grads = run(name, lengths, args)
        except Exception as exc:  # noqa: BLE001 - a kernel this torch cannot run is a result too
            print(json.dumps(dict(kernel=name, error=str(exc)[:400])), flush=True)
            continue
        if ref is None:
            ref = (out, grads)
        else:
            fields["max_diff_out"] = round((out - ref[0]).abs().max().item(), 4)
            fields["max_diff_grads"] = [round((a - b).abs().max().item(), 4) for a, b in zip(grads, ref[1])]
        print(json.dumps(dict(figure="attention_kernel", **fields)), flush=True)


if __name__ == "__main__":
    main()
