"""push → report: what a trained step gives the run, on learner rank 0 (its commit to the ledger is
learner/admission.py's, which holds the step's samples).

push: the new version goes to the publisher, which sends it to every node in the background. report: one
metrics record (RUN/metrics.jsonl and the configured sinks) and one console line.

Other parts add their own figures to each record without a line here: `add_figures` takes a function
that returns a dict of metrics (evaluation scores, a critic's losses, ...), called at each report.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from streamrl.engine.auth import CurveGate
from streamrl.engine.config import Config
from streamrl.engine.config.rules import GROUP_BASELINES
from streamrl.engine.messages import Trajectory
from streamrl.engine.telemetry import EventLog, MetricsSink
from streamrl.engine.transport import REFUSALS
from streamrl.learner.batching import sequence_cost
from streamrl.learner.intake import Intake
from streamrl.learner.nodes import NodeRegistry
from streamrl.learner.publisher import Publisher
from streamrl.learner.selection import Selection
from streamrl.rewards.stats import batch_stats, warn_if_flat

log = logging.getLogger("streamrl.learner")

Figures = Callable[[], Mapping[str, float]]


class StepOutcome:
    """The publisher's push and the step's record.

    `flops_per_token` and `peak_flops` make the MFU (0: none reported); `first_figures` go into the first
    record only (a resumed run's: what the resume rolled back and dropped)."""

    def __init__(
        self,
        cfg: Config,
        intake: Intake,
        registry: NodeRegistry,
        publisher: Publisher,
        version_of: Callable[[], int],
        sink: MetricsSink,
        events: EventLog,
        gate: CurveGate | None = None,
        flops_per_token: float = 0.0,
        peak_flops: float = 0.0,
        first_figures: Mapping[str, float] | None = None,
    ):
        self.cfg, self.intake, self.registry = cfg, intake, registry
        self.publisher, self.version_of, self.sink, self.events, self.gate = publisher, version_of, sink, events, gate
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.once = dict(first_figures or {})  # figures for the next record only
        self.figures: list[Figures] = []  # other parts' figures, asked at each report

    def add_figures(self, figures: Figures) -> None:
        """`figures()` is called at each report; its metrics go into the record as they are named."""
        self.figures.append(figures)

    def publish(self, weights: Mapping[str, Tensor]) -> float:
        """Hand the new version to the publisher (nodes get it in the background); the seconds it held us. The
        `published` event is when nodes may start taking it (bench/scale_out.py's push time starts there)."""
        held = self.publisher.publish(self.version_of(), weights)
        self.events.emit("published", version=self.version_of())
        return held

    def report(
        self, step: int, trained_by: int, metrics: dict, timings: dict[str, float], started: float, selection: Selection
    ) -> None:
        """One metrics record and one console line for the step, whose samples `trained_by` (the version
        the step started from) trained."""
        flat, train = [t for group in selection.groups for t in group], selection.train
        rewards = batch_stats([t.reward for t in flat], [t.group_id for t in flat])
        if self.cfg.loss.advantage in GROUP_BASELINES:  # GAE and REINFORCE++ need no variance inside a group
            warn_if_flat(rewards, step, skipped=bool(metrics.get("skipped_no_gradient")))
        record = {
            **metrics,
            **{k: v for k, v in rewards.as_metrics().items() if math.isfinite(v)},  # none for a step without samples
            **selection.metrics(self.cfg.learner.groups_per_step),
            **selection.episode_figures(),
            **selection.batch_figures(trained_by, time.monotonic() - started),
            **self._time_figures(train, timings),
            **self._node_figures(),
            **self._intake_figures(),
            **self._refusals(),
            **self.once,
        }
        for figures in self.figures:
            record.update(figures())
        self.once = {}
        self.sink.log(step, record)
        self.events.emit("step", step=step, version=self.version_of())
        self._console(step, record)

    def _console(self, step: int, record: Mapping[str, float]) -> None:
        log.info(
            # the step's own rate (its batch over its wall time), not the run's trained tokens/s (ops/progress.py)
            "step %d v%d reward %.3f±%.3f loss %.4f step tokens/s %.0f mismatch_kl %.2e staleness %.2f nodes %d "
            "idle %.0f%%",
            step,
            self.version_of(),
            record.get("reward/mean", math.nan),
            record.get("reward/std", math.nan),
            record["loss"],
            record["tokens_per_s"],
            record.get("mismatch_kl", float("nan")),  # nan on the console only: absent from the record
            record["staleness_mean"],
            record["nodes"],
            100 * record["time/idle_fraction"],
        )

    def _intake_figures(self) -> dict[str, float]:
        """What the intake resolved (samples_<reason>) and what the trajectory stream saw."""
        receiver = self.intake.receiver
        return {
            **{f"samples_{k}": v for k, v in self.intake.counters.items()},
            "gaps": receiver.gaps,
            "duplicates": receiver.duplicates,
            "decode_errors": receiver.decode_errors + self.registry.server.decode_errors,
        }

    def _refusals(self) -> dict[str, int]:
        """Connections and frames refused for not proving who they came from, by where and why (the
        per-sender counts are in the log), and their total as `refused`."""
        tallies = {"trajectory": self.intake.receiver.faults, "control": self.registry.server.faults}
        if self.gate is not None:
            tallies["gate"] = self.gate.faults
        out = {
            f"refused/{where}/{kind}": tally.count(kind)
            for where, tally in tallies.items()
            for kind in REFUSALS
            if tally.count(kind)
        }
        return {"refused": sum(out.values()), **out}

    def _time_figures(self, flat: list[Trajectory], timings: dict[str, float]) -> dict[str, float]:
        """Where the learner's step went: waiting for data (idle), training, the push's hold; the MFU
        counts the training time only."""
        total = max(sum(timings.values()), 1e-9)
        positions = sum(sequence_cost(t) for t in flat)
        out = {f"time/{k}": v for k, v in timings.items()}
        out["time/idle_fraction"] = timings.get("wait_s", 0.0) / total
        # the push's hold split: packing (host; the rest of push_s read the weights) and its device time
        out["time/push_pack_s"] = self.publisher.hold_s
        out["time/push_pack_device_s"] = self.publisher.pack_device_s()
        out["train_tokens_per_s"] = positions / max(timings.get("train_s", 0.0), 1e-9)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["memory/learner_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if self.peak_flops and self.flops_per_token:
            out["mfu"] = self.flops_per_token * out["train_tokens_per_s"] / self.peak_flops
        return out

    def _node_figures(self) -> dict[str, float]:
        """Per node: the weight transfer (learner side) and where the node's own time went."""
        states = self.publisher.states()
        out: dict[str, float] = {"nodes": self.registry.count, "evicted": self.registry.evicted}
        out["weights_s"] = max((w.last_transfer_s for w in states.values()), default=0.0)
        for node_id, weights in states.items():
            info = self.registry.nodes.get(node_id)
            out[f"node/{node_id}/applied_version"] = weights.applied
            out[f"node/{node_id}/transfer_s"] = weights.last_transfer_s
            out[f"node/{node_id}/live_s"] = weights.last_swap_s
            if info is not None:
                out[f"node/{node_id}/generate_s"] = info.generate_s
                out[f"node/{node_id}/idle_s"] = info.idle_s
                out[f"node/{node_id}/swap_s"] = info.swap_s
                if info.peak_gib:
                    out[f"node/{node_id}/peak_gib"] = info.peak_gib
        return out
