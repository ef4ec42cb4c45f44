"""One safe optimizer step over packed micro-batches.

micro-batches -> forward (logprobs + entropy, chunked over the vocabulary) -> loss (divided by the
global normaliser) -> backward -> clip -> optimizer step. A non-finite gradient norm skips the
step: gradients are zeroed, the skip is counted and logged with the offending parameter names,
and neither the weights nor the optimizer state move.

The skip is decided on the device: the fused AdamW kernel reads a `found_inf` flag and leaves
parameters, moments and step counts alone when it is set. So the host never waits for backward
to end before it queues the optimizer, and the step's one host sync comes after the update, when
the metrics are read.
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor, nn

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.learner import parallel
from streamrl.learner.batching import MicroBatch
from streamrl.learner.losses import local_normalizer, policy_loss, summarize

log = parallel.rank0_logger("streamrl.learner")


def compute_logprobs(model: nn.Module, mb: MicroBatch) -> tuple[Tensor, Tensor]:
    """(logprobs, entropy), each [T] fp32, of the micro-batch's targets under `model`."""
    return model(mb.input_ids, mb.position_ids, mb.targets, mb.cu_seqlens, mb.max_seqlen)


def _filler(device: torch.device) -> MicroBatch:
    """A one-position micro-batch with no loss token: keeps a rank with fewer micro-batches in step."""
    zero_i, zero_f = torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, device=device)
    return MicroBatch(
        input_ids=zero_i,
        position_ids=zero_i,
        targets=zero_i,
        loss_mask=torch.zeros(1, dtype=torch.bool, device=device),
        behavior_logprobs=zero_f,
        advantages=zero_f,
        versions=zero_i - 1,
        seq_ids=zero_i,
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=device),
        max_seqlen=1,
    )


class Trainer:
    """Owns the optimizer and the policy version; `step` trains on one batch of micro-batches."""

    def __init__(
        self,
        model: nn.Module,
        loss_cfg: LossConfig,
        cfg: LearnerConfig,
        device: torch.device,
        ref_model: nn.Module | None = None,
        gather_ahead: bool = True,
    ):
        """gather_ahead: gather the next forward's parameters right after each update (off when the
        caller takes a state dict after every step: that reshards the model and wastes the gather)."""
        self.model, self.loss_cfg, self.cfg, self.device = model, loss_cfg, cfg, device
        self.ref_model, self.gather_ahead = ref_model, gather_ahead
        # the sharded parameters, which hold the gradients: between a step and the next forward the module
        # shows its gathered copies instead (gather_for_next_forward)
        self.named_params = list(model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.named_params], lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True
        )
        warmup = max(cfg.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self.version = 0
        self.skipped_steps = 0
        self.last_nonfinite: list[str] = []  # parameters named by the last skipped step

    def global_normalizer(self, micro_batches: list[MicroBatch], global_token_count: float | None) -> float:
        """Loss tokens (or sequences) of the whole step over all ranks: one all-reduce.

        From the counts taken when the micro-batches were packed: no device round trip, and no CPU tensor
        op either (a CPU sum of the loss mask stalled the host for about 10 ms per step on an H200 host,
        with the GPU idle; bench/RESULTS.md)."""
        if global_token_count is not None and self.loss_cfg.aggregation == "token":
            return float(global_token_count)
        return parallel.sum_over_ranks(sum(self._local_normalizer(mb) for mb in micro_batches), self.device)

    def _local_normalizer(self, mb: MicroBatch) -> float:
        counted = mb.loss_tokens if self.loss_cfg.aggregation == "token" else mb.loss_sequences
        if counted is not None:
            return float(counted)
        return float(local_normalizer(mb.loss_mask, mb.seq_ids, self.loss_cfg))

    def _forward_backward(self, mb: MicroBatch, normalizer: float) -> dict[str, Tensor]:
        logprobs, entropy = compute_logprobs(self.model, mb)
        ref = None
        if self.loss_cfg.kl_coef > 0:
            if self.ref_model is None:
                raise ValueError("loss.kl_coef > 0 needs a reference model: pass ref_model to Trainer")
            with torch.no_grad():
                ref, _ = compute_logprobs(self.ref_model, mb)
        loss, stats = policy_loss(
            logprobs,
            mb.behavior_logprobs,
            mb.advantages,
            mb.loss_mask,
            self.loss_cfg,
            seq_ids=mb.seq_ids,
            ref_logprobs=ref,
            entropy=entropy,
            normalizer=normalizer,
            same_version=mb.versions == self.version,
        )
        loss.backward()
        return stats

    def step(self, micro_batches: list[MicroBatch], global_token_count: float | None = None) -> dict[str, float]:
        """Train on this rank's micro-batches; metrics are reduced over ranks (same dict on every rank)."""
        start = time.perf_counter()
        normalizer = self.global_normalizer(micro_batches, global_token_count)
        rounds = parallel.max_over_ranks(len(micro_batches), self.device)
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        micro_batches += [_filler(self.device) for _ in range(rounds - len(micro_batches))]
        sums: dict[str, Tensor] = {}
        for i, mb in enumerate(micro_batches):
            parallel.set_grad_sync(self.model, i == len(micro_batches) - 1)
            for key, value in self._forward_backward(mb, normalizer).items():
                sums[key] = _combine(key, sums.get(key), value.detach())
        grad_norm = self._clip()
        self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()  # the fused kernel skips on it
        self.optimizer.step()
        if self.gather_ahead:
            parallel.gather_for_next_forward(self.model)
        sums["grad_norm"] = grad_norm
        values = _to_host(sums)  # the step's host sync: everything above is queued by now
        norm = values.pop("grad_norm")
        bad = [] if math.isfinite(norm) else self._nonfinite_names()
        if bad:
            self._skip(bad, norm)
        else:
            self.scheduler.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        values["positions"] = float(sum(mb.num_tokens for mb in micro_batches))
        reduced = parallel.reduce_metrics(values, self.device)
        metrics = summarize(reduced)
        metrics.update(
            loss=reduced["loss_sum"] / max(normalizer, 1.0),
            positions=reduced["positions"],
            grad_norm=norm,
            skipped=float(bool(bad)),
            skipped_steps=float(self.skipped_steps),
            version=float(self.version),
            normalizer=normalizer,
            lr=self.scheduler.get_last_lr()[0],
            step_seconds=time.perf_counter() - start,
        )
        return metrics

    def _clip(self) -> Tensor:
        """The global gradient norm (a device tensor); gradients clipped to max_grad_norm when it is finite.

        A non-finite norm leaves the gradients as they are, so the parameters that carry the bad
        values can still be named.
        """
        params = [p for _, p in self.named_params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        finite = torch.isfinite(norm)
        torch.nn.utils.clip_grads_with_norm_(
            params, self.cfg.max_grad_norm, torch.where(finite, norm, 0.0), foreach=True
        )
        return norm

    def _nonfinite_names(self) -> list[str]:
        local = [
            name
            for name, p in self.named_params
            if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())
        ]
        return parallel.gather_names([parallel.hf_name(n.removeprefix("lm.")) for n in local]) or ["?"]

    def _skip(self, names: list[str], grad_norm: float) -> None:
        self.skipped_steps += 1
        self.last_nonfinite = names
        shown = ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")
        log.warning(
            "step skipped at version %d: gradient norm %s; non-finite gradients in %s (%d skipped so far)",
            self.version,
            grad_norm,
            shown,
            self.skipped_steps,
        )


def _to_host(values: dict[str, Tensor]) -> dict[str, float]:
    """Device scalars to floats with one transfer."""
    keys = list(values)
    stacked = torch.stack([values[k].detach().to(torch.float64).reshape(()) for k in keys])
    return dict(zip(keys, stacked.tolist()))


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _combine(key: str, old: Tensor | None, new: Tensor) -> Tensor:
    if old is None:
        return new
    if key.endswith("_max"):
        return torch.maximum(old, new)
    if key.endswith("_min"):
        return torch.minimum(old, new)
    return old + new
