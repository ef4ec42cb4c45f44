"""A step's figures: the metrics of its updates, put together from their reduced sums, and the device's
peak for the MFU."""

from __future__ import annotations

import math

import torch

from streamrl.learner.losses import summarize

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16, by device name


def peak_flops(device: torch.device) -> float:
    """The device's dense bf16 peak (for the MFU), when it is one we know; else 0 (no MFU reported)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), 0.0)


def update_metrics(reduced: dict[str, float], results: list, passes: int = 1) -> dict[str, float]:
    """The step's metrics from every update's reduced sums; each update's too, under update/<k>/, when more
    than one was taken. The step's loss is over all its updates' loss tokens (or sequences); its grad_norm is
    the largest update's (a non-finite one if any); its `tokens` and `mismatch_samples` count the batch once
    (the first pass), however many passes saw it."""
    per_update = [
        {k.partition("/")[2]: v for k, v in reduced.items() if k.startswith(f"{u}/")} for u in range(len(results))
    ]
    total: dict[str, float] = {}
    for sums in per_update:
        for key, value in sums.items():
            total[key] = merge(key, total.get(key), value)
    norms = [r.grad_norm for r in results]
    normalizers = [r.normalizer for r in results]
    metrics = summarize(total)
    first_pass = per_update[: len(results) // passes]
    for key in ("tokens", "mismatch_samples"):
        metrics[key] = sum(sums.get(key, 0.0) for sums in first_pass)
    metrics.update(
        loss=total.get("loss_sum", 0.0) / max(sum(normalizers), 1.0),
        grad_norm=next((n for n in norms if not math.isfinite(n)), max(norms)),
        normalizer=sum(normalizers),
        updates=float(sum(r.applied for r in results)),
        skipped_nonfinite=float(sum(r.skipped == "nonfinite" for r in results)),
        skipped_no_gradient=float(sum(r.skipped == "no_gradient" for r in results)),
    )
    if len(results) > 1:
        for u, (sums, result) in enumerate(zip(per_update, results), start=1):
            one = summarize(sums)
            one.update(
                loss=sums.get("loss_sum", 0.0) / max(result.normalizer, 1.0),
                grad_norm=result.grad_norm,
                skipped=float(not result.applied),
                normalizer=result.normalizer,
            )
            metrics.update({f"update/{u}/{k}": v for k, v in one.items()})
    return metrics


def merge(key: str, old: float | None, new: float) -> float:
    """Two reduced sums of one metric: `_max` and `_min` keys keep their extreme, the rest add up
    (train_step._combine does the same on device tensors)."""
    if old is None:
        return new
    return max(old, new) if key.endswith("_max") else min(old, new) if key.endswith("_min") else old + new
