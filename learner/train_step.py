"""One learner step over packed micro-batches: `learner.mini_batches` x `learner.epochs` safe optimizer updates.

micro-batches -> mini-batches (whole sequences, balanced by positions; minibatch.py) -> [no-grad pass:
proximal logprobs (more than one update) and the reference's (kl_coef > 0)] -> per epoch, per mini-batch:
forward (logprobs + entropy, chunked over the vocabulary) -> loss (divided by the mini-batch's global
normaliser) -> backward -> clip -> optimizer update.

Mini-batch PPO as decoupled PPO (Hilton et al. 2022): pi_prox is the weights the step starts from,
computed once, so the clip acts on updates 2..N of every epoch (on the very first, pi_theta = pi_prox);
with one update it is pi_theta detached, exactly, and the extra forward is saved. The policy version
moves once per step, not per update: one version per pushed set of weights, which is what a sample's
staleness counts.

An update is skipped, leaving weights, optimizer state (AdamW's moments and step counts) and the version
untouched, when its gradient norm is not finite (counted and logged with the offending parameter names),
or when it is exactly zero: a loss with no non-zero advantage (and no KL or entropy term) has no
gradient, and an AdamW step on zeros would still move the weights by momentum and weight decay. The skip
is decided on the device: the fused AdamW kernel reads a `found_inf` flag and leaves parameters, moments
and step counts alone when it is set. So the host never waits for backward to end before it queues the
optimizer, and each update's one host sync comes after it, when its metrics are read. A step with no
update applied does not move the version (nothing is pushed); its samples are the orchestrator's to drop.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.learner import parallel
from streamrl.learner.batching import MicroBatch, loss_free
from streamrl.learner.critic.trainer import Shaper
from streamrl.learner.losses import local_normalizer, policy_loss, summarize
from streamrl.learner.minibatch import split_updates
from streamrl.learner.reference import BaseReference, release
from streamrl.learner.step_metrics import update_metrics

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
        ref_model: nn.Module | BaseReference | None = None,
        gather_ahead: bool = True,
        shaper: Shaper | None = None,
    ):
        """gather_ahead: gather the next forward's parameters right after each update (off when the
        caller takes a state dict after every step: that reshards the model and wastes the gather).
        shaper: per-token advantages (GAE with the critic, REINFORCE++; learner/critic/), made on each rank
        from the scores the micro-batches carry, and the critic's updates on the same mini-batches."""
        self.model, self.loss_cfg, self.cfg, self.device = model, loss_cfg, cfg, device
        self.ref_model, self.gather_ahead, self.shaper = ref_model, gather_ahead, shaper
        # the sharded parameters, which hold the gradients: between a step and the next forward the module
        # shows its gathered copies instead (gather_for_next_forward)
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # LoRA: adapters
        self.optimizer = torch.optim.AdamW(
            [p for _, p in self.named_params], lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True
        )
        warmup = max(cfg.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )
        self._advance(to=0)
        self.skipped_steps = 0  # updates skipped for a non-finite gradient (kept in checkpoints)
        self.no_gradient_updates = 0  # updates skipped for a zero gradient, since this process started
        self.last_nonfinite: list[str] = []  # parameters named by the last skipped step

    @property
    def version(self) -> int:
        """The policy version: optimizer steps that applied an update (a resumed run's included). Read-only;
        the publisher, checkpoints and the nodes' welcome ask it here."""
        return self._version

    def _advance(self, to: int | None = None) -> None:
        """The one write of the version: a step that applied an update moves it by one; the start and
        `load_state_dict` set it."""
        self._version = self._version + 1 if to is None else to

    def state_dict(self) -> dict[str, int | float | None]:
        """What a checkpoint keeps of the trainer besides the model, optimizer and schedule."""
        critic = self.shaper.state_dict() if self.shaper is not None else {}
        return {"version": self.version, "skipped_steps": self.skipped_steps, **critic}

    def load_state_dict(self, state: dict[str, int | float | None]) -> None:
        self._advance(to=int(state["version"]))
        self.skipped_steps = int(state["skipped_steps"])
        if self.shaper is not None:
            self.shaper.load_state_dict(state)

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

    def _plan(self, minis: list[list[MicroBatch]], global_token_count: float | None) -> tuple[list[float], int]:
        """Each update's global normaliser (its mini-batch's loss tokens or sequences over all ranks) and the
        micro-batch rounds every rank runs per update (the most any rank has): one reduction for all."""
        if len(minis) == 1:
            normalizer = self.global_normalizer(minis[0], global_token_count)
            return [normalizer], parallel.max_over_ranks(len(minis[0]), self.device)
        local = {f"normalizer/{u}": sum(self._local_normalizer(mb) for mb in mini) for u, mini in enumerate(minis)}
        local["rounds_max"] = max(len(mini) for mini in minis)
        reduced = parallel.reduce_metrics(local, self.device)
        return [reduced[f"normalizer/{u}"] for u in range(len(minis))], int(reduced["rounds_max"])

    def _forward_backward(
        self, mb: MicroBatch, normalizer: float, proximal: Tensor | None, ref: Tensor | None
    ) -> dict[str, Tensor]:
        logprobs, entropy = compute_logprobs(self.model, mb)
        loss, stats = policy_loss(
            logprobs,
            mb.behavior_logprobs,
            mb.advantages,
            mb.loss_mask,
            self.loss_cfg,
            seq_ids=mb.seq_ids,
            proximal_logprobs=proximal,
            ref_logprobs=ref,
            entropy=entropy,
            normalizer=normalizer,
            same_version=mb.versions == self.version,
        )
        loss.backward()
        return stats

    def _before_updates(
        self, minis: list[list[MicroBatch]], passes: int = 1
    ) -> list[list[tuple[Tensor | None, Tensor | None]]]:
        """(proximal, reference) logprobs of every micro-batch, from no-grad forwards before the first update.

        pi_prox is the weights the step starts from, needed only when there is more than one update (with
        one, pi_theta detached is pi_prox exactly, and the forward is saved); every pass uses the same.
        Fillers run too: every rank must take part in the same number of forwards (each all-gathers its
        sharded units)."""
        proximal, kl = len(minis) * passes > 1, self.loss_cfg.kl_coef > 0
        if not (proximal or kl):
            return [[(None, None)] * len(mini) for mini in minis]
        if kl and self.ref_model is None:
            raise ValueError("loss.kl_coef > 0 needs a reference model: pass ref_model to Trainer")
        with torch.no_grad():
            out = [
                [
                    (
                        compute_logprobs(self.model, mb)[0] if proximal else None,
                        compute_logprobs(self.ref_model, mb)[0] if kl else None,
                    )
                    for mb in mini
                ]
                for mini in minis
            ]
        if kl:
            release(self.ref_model)
        return out

    def step(self, micro_batches: list[MicroBatch], global_token_count: float | None = None) -> dict[str, float]:
        """Train on this rank's micro-batches: `epochs` passes of one optimizer update per mini-batch.

        Metrics are reduced over ranks (the same dict on every rank): the step's, and with more than one
        update each update's under `update/<k>/`. The policy version moves once, when any update was taken.
        """
        start = time.perf_counter()
        micro_batches = [mb.to(self.device) for mb in micro_batches]
        minis = split_updates(micro_batches, self.cfg.mini_batches)
        normalizers, rounds = self._plan(minis, global_token_count)
        # a mini-batch with no loss token on any rank has no gradient: no update (the normalisers are global,
        # so every rank keeps the same ones)
        kept = [u for u, n in enumerate(normalizers) if n > 0]
        if not kept:
            return self._nothing_to_train(micro_batches, start)
        minis, normalizers = [minis[u] for u in kept], [normalizers[u] for u in kept]
        minis = [mini + [_filler(self.device) for _ in range(rounds - len(mini))] for mini in minis]
        critic: dict[str, float] = {}
        if self.shaper is not None:  # per-token advantages; the critic trains (alone during its warm-up)
            minis, waits = self.shaper.advantages(minis), self.shaper.actor_waits()
            critic = self.shaper.train(minis, normalizers, self.cfg.epochs)
            if waits:
                return {**self._nothing_to_train(micro_batches, start), **critic}
        before = self._before_updates(minis, passes=self.cfg.epochs)
        results = [
            self._update(mini, n, extra)
            for _ in range(self.cfg.epochs)
            for mini, n, extra in zip(minis, normalizers, before)
        ]
        applied = sum(1 for r in results if r.applied)
        if applied:
            self.scheduler.step()
            self._advance()
        local = {f"{u}/{k}": v for u, r in enumerate(results) for k, v in r.sums.items()}
        local["positions"] = float(sum(mb.num_tokens for mb in micro_batches))
        reduced = parallel.reduce_metrics(local, self.device)
        metrics = update_metrics(reduced, results, passes=self.cfg.epochs)
        metrics.update(positions=reduced["positions"], step_seconds=time.perf_counter() - start)
        return {**metrics, **critic, **self._counters(applied)}

    def _nothing_to_train(self, micro_batches: list[MicroBatch], start: float) -> dict[str, float]:
        """A step without a loss token on any rank (e.g. every sample masked out): no forward, no update."""
        positions = parallel.reduce_metrics(
            {"positions": float(sum(mb.num_tokens for mb in micro_batches))}, self.device
        )
        self.no_gradient_updates += 1
        metrics = summarize({})
        metrics.update(loss=0.0, grad_norm=0.0, normalizer=0.0, updates=0.0, skipped_nonfinite=0.0)
        metrics.update(skipped_no_gradient=1.0, positions=positions["positions"])
        return {**metrics, "step_seconds": time.perf_counter() - start, **self._counters(0)}

    def _counters(self, applied: int) -> dict[str, float]:
        return {
            "skipped": float(not applied),
            "skipped_steps": float(self.skipped_steps),
            "no_gradient_updates": float(self.no_gradient_updates),
            "version": float(self.version),
            "lr": self.scheduler.get_last_lr()[0],
        }

    def warm_up(self) -> float:
        """Compile ahead of the first step; the seconds it took.

        Forward and backward over loss-free micro-batches of four sizes a bucket apart below the budget (the
        orchestrator's buckets at the default `pad_buckets`; any sizes that differ serve), in two rounds shaped
        like a step's (gradient sync off, then on). torch compiles the first size as static and the next with
        the varying sizes (positions, sequences, longest sequence) symbolic, which then serves every later
        micro-batch: no step recompiles mid-run. The gradients are dropped: weights, optimizer state and version
        stay as they were."""
        start = time.perf_counter()
        budget = self.cfg.micro_batch_tokens
        stride = max(1, budget // max(self.cfg.pad_buckets, 8))
        sizes = [(max(4, budget - k * stride), k + 2) for k in range(4)]
        for round_ in (sizes[:2], sizes[2:]):
            for i, (positions, sequences) in enumerate(round_):
                parallel.set_grad_sync(self.model, i == len(round_) - 1)
                self._forward_backward(loss_free(positions, sequences).to(self.device), 1.0, None, None)
        self.optimizer.zero_grad(set_to_none=True)
        if self.gather_ahead:
            parallel.gather_for_next_forward(self.model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _update(
        self, micro_batches: list[MicroBatch], normalizer: float, extra: list[tuple[Tensor | None, Tensor | None]]
    ) -> _Update:
        """One optimizer update over one mini-batch's micro-batches; its one host sync reads its statistics."""
        sums: dict[str, Tensor] = {}
        for i, (mb, (proximal, ref)) in enumerate(zip(micro_batches, extra)):
            parallel.set_grad_sync(self.model, i == len(micro_batches) - 1)
            for key, value in self._forward_backward(mb, normalizer, proximal, ref).items():
                sums[key] = _combine(key, sums.get(key), value.detach())
        grad_norm = self._clip()
        # the fused kernel skips on it: a non-finite gradient, or none at all (AdamW would move the weights by
        # momentum and weight decay alone)
        self.optimizer.found_inf = ((~torch.isfinite(grad_norm)) | (grad_norm == 0)).float()
        self.optimizer.step()
        if self.gather_ahead:
            parallel.gather_for_next_forward(self.model)
        sums["grad_norm"] = grad_norm
        values = _to_host(sums)  # the update's host sync: everything above is queued by now
        norm = values.pop("grad_norm")
        skipped = "nonfinite" if not math.isfinite(norm) else "no_gradient" if norm == 0 else ""
        if skipped == "nonfinite":
            self._skip(self._nonfinite_names(), norm)
        elif skipped:
            self.no_gradient_updates += 1
        self.optimizer.zero_grad(set_to_none=True)
        return _Update(sums=values, grad_norm=norm, normalizer=normalizer, skipped=skipped)

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
            "update skipped at version %d: gradient norm %s; non-finite gradients in %s (%d skipped so far)",
            self.version,
            grad_norm,
            shown,
            self.skipped_steps,
        )


@dataclass
class _Update:
    sums: dict[str, float]  # this rank's statistics as sums (losses.policy_loss), not yet reduced
    grad_norm: float  # global
    normalizer: float  # global
    skipped: str  # "nonfinite" or "no_gradient": the optimizer left everything as it was; "" when applied

    @property
    def applied(self) -> bool:
        return not self.skipped


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
