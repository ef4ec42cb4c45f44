"""Where a learner step's GPU time goes (torch profiler): kernels by kind, the idle gaps between them and
the host syncs that cause them. Used by bench/learner_step.py (`--profile`)."""

from __future__ import annotations

import re
import time

import torch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


KERNEL_KINDS = [
    ("attention", re.compile(r"flash|fmha|attn|varlen|sdpa|cudnn", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma|sm90_", re.I)),
    ("comms", re.compile(r"nccl", re.I)),
    ("optimizer", re.compile(r"adam", re.I)),
    ("fused (triton)", re.compile(r"triton", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
]


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "elementwise/other")


def gaps(kernels: list[tuple[str, float, float]]) -> list[tuple[float, float]]:
    """(start, end) of every stretch (us clock) between the first and last kernel with no kernel running."""
    out, reach = [], None
    for _, begin, end in sorted(kernels, key=lambda k: k[1]):
        if reach is not None and begin > reach:
            out.append((reach, begin))
        reach = end if reach is None else max(reach, end)
    return out


def idle_gaps(
    kernels: list[tuple[str, float, float]], host: list[tuple[str, float, float]], top: int = 6, min_us: float = 300.0
) -> list[dict]:
    """The longest stretches (us clock) with no kernel running, longest first, each with the most specific
    host ops that covered at least half of it: what the GPU was waiting for."""
    out = []
    long = [(a, b) for a, b in gaps(kernels) if b - a >= min_us]
    for a, b in sorted(long, key=lambda g: g[0] - g[1])[:top]:
        covering = [(end - begin, name) for name, begin, end in host if min(b, end) - max(a, begin) >= (b - a) / 2]
        names = list(dict.fromkeys(name for _, name in sorted(covering)))[:3]
        out.append({"ms": round((b - a) / 1e3, 2), "host": names})
    return out


def host_syncs(step) -> list[str]:
    """Where one step makes the host wait for the GPU (torch's sync debug mode): file:line, deduplicated.
    The step means one, at its end (the metrics); any other costs the host its lead over the GPU."""
    if not torch.cuda.is_available():
        return []
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sorted(
        {
            f"{w.filename.rsplit('/', 2)[-1] if '/' in w.filename else w.filename}:{w.lineno}"
            for w in caught
            if "synchroniz" in str(w.message)
        }
    )


def gap_totals(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """Milliseconds the GPU sat idle between kernels, by gap length: launch gaps (< 20 us), short stalls,
    and gaps of 300 us or more (the host behind, or a sync)."""
    totals = {"under_20us": 0.0, "20us_to_300us": 0.0, "over_300us": 0.0}
    for a, b in gaps(kernels):
        key = "under_20us" if b - a < 20 else "20us_to_300us" if b - a < 300 else "over_300us"
        totals[key] += (b - a) / 1e3
    return {k: round(v, 2) for k, v in totals.items()}


def profile(step, path: str | None, steps: int = 2) -> dict:
    """`steps` steps under the profiler, figures per step: GPU time per kernel kind, kernels launched, idle
    time between kernels by gap length, the longest gaps (one is the step boundary) with what the host did
    meanwhile, and the host syncs of one more step. Top kernels to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync()
    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    kernels = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    host = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CPU
    ]
    by_kind: dict[str, float] = {}
    for name, begin, end in kernels:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + (end - begin) / 1e3 / steps
    span = max(end for _, _, end in kernels) - min(begin for _, begin, _ in kernels) if kernels else 0.0
    busy_ms = (span - sum(b - a for a, b in gaps(kernels))) / 1e3 / steps  # union: comms overlap compute
    if path:
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60, max_name_column_width=90))
            f.write(
                "\n\n"
                + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=90)
            )
    return {
        "profiled_step_ms": round(wall_ms, 1),
        "gpu_busy_ms": round(busy_ms, 1),
        "gpu_busy_fraction": round(busy_ms / wall_ms, 3),
        "kernels_per_step": len(kernels) // steps,
        "gpu_ms_by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "gpu_idle_ms_by_gap": {k: round(v / steps, 2) for k, v in gap_totals(kernels).items()},
        "gpu_idle_gaps": idle_gaps(kernels, host),
        "host_syncs": host_syncs(step),
    }
