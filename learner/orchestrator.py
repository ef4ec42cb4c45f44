"""Learner rank 0's orchestrator: the run's I/O around the training step.

receive → admit (`Intake`, through the ledger) → advantages → per-rank micro-batches balanced by
tokens → (every rank trains) → commit (ledger) → push (`Publisher`) → report (metrics, console).
It also serves the nodes between receives (`NodeRegistry`: joins get the latest weights, departures
and lost nodes are resolved). The policy version is the trainer's (`version_of()` asks it); the
orchestrator publishes it to the ledger at each commit and hands it to every node that registers.

Faults: each learner is one incarnation of the run, announced in `RUN/learner.json` and in the ledger,
so nodes left running by a dead learner register with the next one. A resumed learner makes the
books match its checkpoint (`_claim_run`); a run that trains nothing for `learner.stall_stop_s`
stops (`StallAlarm`); at the end, everything the learner or a gone node still holds is resolved and
the run is marked finished, so `streamrl status` can tell an unresolved sample from one on its way.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import time
import uuid
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from streamrl.engine.auth import open_gate
from streamrl.engine.config import Config, ConfigError
from streamrl.engine.config.presets import completion_limit
from streamrl.engine.control import ControlServer
from streamrl.engine.ledger import LedgerUnavailableError, open_ledger
from streamrl.engine.messages import AdapterSpec, Trajectory, Welcome
from streamrl.engine.redis_server import redact
from streamrl.engine.telemetry import EventLog, MetricsSink
from streamrl.engine.transport import REFUSALS, TrajectoryReceiver, bind_address
from streamrl.engine.weights.paths import this_process
from streamrl.learner.batching import StepBatch, pack_for_ranks, sequence_cost
from streamrl.learner.heartbeat import LearnerHeartbeat
from streamrl.learner.intake import NO_NODE_WARN_S, WAITING_WARN_S, Intake, RewardWatch, StallAlarm
from streamrl.learner.nodes import NodeRegistry
from streamrl.learner.overdue import OverdueGroups
from streamrl.learner.publisher import Publisher
from streamrl.learner.selection import Selection, select, warn_unfilled
from streamrl.learner.step_metrics import peak_flops
from streamrl.rewards.stats import batch_stats, warn_if_flat

log = logging.getLogger("streamrl.learner")

REAP_EVERY_S = 2.0


class Orchestrator:
    """Everything rank 0 does besides training; built once, `close()`d once."""

    def __init__(
        self,
        cfg: Config,
        device: torch.device,
        version_of: Callable[[], int],
        resumed_version: int | None = None,
        compiled: bool = False,
        params: int = 0,
        first_step: int = 1,
        adapter: AdapterSpec | None = None,
        flops_per_token: float = 0.0,
    ):
        """params: the model's; flops_per_token: a step's FLOPs per position for the MFU (default 6 x params;
        LoRA: 4 x params for the frozen base, forward and input gradients, + 6 x the adapters'); adapter:
        LoRA's spec, pushed with each version's adapter tensors."""
        self.cfg, self.version_of, self.compiled, self.params = cfg, version_of, compiled, params
        self.flops_per_token = flops_per_token or 6 * params
        self._first_step = first_step
        self.peak_flops = peak_flops(device)
        self.incarnation = uuid.uuid4().hex[:12]
        self.ledger, self.redis = open_ledger(cfg.ledger, cfg.run.name, cfg.run.path)
        self.gate = None
        try:
            self.resume_figures = self._claim_run(resumed_version)
            self.redis_url = cfg.ledger.url or self.redis.url
            t = cfg.transport
            self.gate = open_gate(cfg)  # CURVE keys and their gatekeeper; None on loopback without CURVE
            caps = dict(max_frame_mb=t.max_frame_mb, fault_log_interval_s=t.fault_log_interval_s, gate=self.gate)
            server = ControlServer(bind_address(t.host, t.control_port), t.send_timeout_s, **caps)
            self.events = EventLog(cfg.run.path, "learner")  # what the live view reads (ops/phases.py)
            self.registry = NodeRegistry(server, self._welcome, self.events)
            # frames are admitted only from registered nodes: the receiver asks the registry who they are
            receiver = TrajectoryReceiver(
                bind_address(t.host, t.trajectory_port), hwm=t.hwm, identities=self.registry.identity, **caps
            )
            alarm = StallAlarm(cfg.learner.stall_warn_s, cfg.learner.stall_stop_s, self.ledger.counts)
            # the wait for the oldest admitted groups: a node that died holding one is reaped within a TTL
            patience = min(cfg.ledger.heartbeat_ttl_s * 1.5, 30.0)
            window = 2 * cfg.learner.groups_per_step * cfg.rollout.group_size  # 2 steps' worth of samples
            rewards, overdue = RewardWatch(window), OverdueGroups(self.ledger, self.registry.silent_s, window)
            self.intake = Intake(receiver, self.ledger, alarm, patience, rewards, overdue)
            self.intake.events = self.events
            self.publisher = Publisher(cfg, self.registry, device, adapter)
            self.sink = MetricsSink(cfg.run.path, cfg.telemetry)
        except BaseException:
            if self.gate is not None:
                self.gate.close()
            if self.redis is not None:
                self.redis.stop()
            raise
        self.selection = Selection()  # the step's groups and what it trains of them, until reported
        self._last_reap = 0.0
        self.ledger.announce_learner(self.incarnation, self.registry.addr, self.intake.addr)
        self.heartbeat = LearnerHeartbeat(self.ledger, self.incarnation)
        self.heartbeat.start()
        self.registry.start()
        self._write_address_file(cfg.run.path)
        self.events.emit("up", control=self.registry.addr, trajectories=self.intake.addr)
        where = (self.registry.addr, self.intake.addr, self.redis_url.split("@")[-1], self.incarnation)
        log.info("learner up: control %s, trajectories %s, ledger %s (incarnation %s)", *where)

    def steps_left(self, next_step: int) -> int:
        """Steps still to train from `next_step` on: the ledger admits no group beyond what they train."""
        return max(0, self.cfg.run.steps - next_step + 1)

    def _claim_run(self, resumed_version: int | None) -> dict[str, int]:
        """A fresh learner refuses a run that already trained (it would continue its versions with fresh
        weights). A learner resumed from a checkpoint of policy `resumed_version` makes the books match
        it: what its predecessor took in but never trained is dropped as `preempted`, and the samples
        trained in steps the checkpoint does not contain become `rolled_back` (the version goes back to
        the checkpoint's). The figures go into the first metrics record of the resumed run."""
        ledger_version = self.ledger.current_version()
        if resumed_version is None and ledger_version > 0:
            raise ConfigError(
                f"run {self.cfg.run.name!r} already trained to version {ledger_version} (its "
                "ledger says so): pass --resume latest to continue it, or set run.name to start a new run"
            )
        if resumed_version is not None and resumed_version > ledger_version:
            raise ConfigError(
                f"the checkpoint is of version {resumed_version} but run {self.cfg.run.name!r}'s ledger is at "
                f"version {ledger_version}: they are not of one run (another run's checkpoint, or a ledger.url "
                "that does not hold this run's books); resume with the run's own ledger and checkpoints"
            )
        self.ledger.init_run(self.cfg.learner.groups_per_step, self.cfg.run.mode, self.steps_left(self._first_step))
        if resumed_version is None:
            return {}
        preempted = self.ledger.drop_received("preempted")
        rolled_back = self.ledger.roll_back(resumed_version) if ledger_version > resumed_version else 0
        log.warning(
            "resuming at version %d (the ledger was at %d): %d samples trained after the checkpoint are "
            "rolled back, %d received but never trained are dropped as preempted",
            resumed_version,
            ledger_version,
            rolled_back,
            preempted,
        )
        return {
            "resume/rolled_back_samples": rolled_back,
            "resume/rolled_back_versions": ledger_version - resumed_version,
            "resume/preempted_samples": preempted,
        }

    def _welcome(self, node_id: str) -> Welcome:
        return Welcome(
            node_id=node_id,
            trajectory_addr=self.intake.addr,
            redis_url=self.redis_url if self.gate is not None else "",  # the password only to an authenticated node
            run_name=self.cfg.run.name,
            policy_version=self.version_of(),
            weights_path=self.publisher.path_for(self.registry.location(node_id)),
        )

    def _write_address_file(self, run_dir: pathlib.Path) -> None:
        """`RUN/learner.json`: where nodes find this learner (`streamrl rollout --learner RUN_FOLDER`)."""
        path = run_dir / "learner.json"
        tmp = path.with_suffix(".tmp")
        addresses = {"control_addr": self.registry.addr, "trajectory_addr": self.intake.addr}
        # no credentials here: the file is readable by others, and nodes get the ledger's URL in their Welcome;
        # the process: `streamrl status` on this machine tells a killed learner from a live one at once
        record = {**addresses, "redis_url": redact(self.redis_url), "run": self.cfg.run.name}
        tmp.write_text(json.dumps({**record, "incarnation": self.incarnation, **this_process()}))
        tmp.rename(path)

    # ---- receive → admit → pack --------------------------------------------------------------

    def next_batch(self, ranks: int, step: int = 0) -> list[StepBatch]:
        """The next step's samples (learner/selection.py: overlong penalty, dynamic sampling, truncated
        completions masked), as each rank's micro-batches (balanced by tokens)."""
        version, learner = self.version_of(), self.cfg.learner

        def take(n: int, holding: set[str]) -> list[list[Trajectory]]:
            return self.intake.collect(n, version, self.serve_nodes, self._hint, holding=holding,
                                       warn_after=self._warn_after)  # fmt: skip

        self.selection = select(take, self._drop, learner.groups_per_step, self.cfg.loss, completion_limit(self.cfg))
        warn_unfilled(step, self.selection, learner.groups_per_step, self.cfg.loss)
        train = self.selection.train
        pad = learner.micro_batch_tokens // learner.pad_buckets if self.compiled and learner.pad_buckets else 0
        per_rank = pack_for_ranks(train, self.selection.advantages, ranks, learner.micro_batch_tokens, pad_multiple=pad)
        return [StepBatch(mbs, version, sum(t.model_tokens for t in train)) for mbs in per_rank]

    def _drop(self, sample_ids: list[str], reason: str) -> None:
        """Samples the step leaves out (zero_variance, truncated): resolved, counted as samples_<reason>."""
        self.ledger.drop(sample_ids, reason)
        self.intake.counters.update({reason: len(sample_ids)})

    def _warn_after(self) -> float:
        return WAITING_WARN_S if self.registry.count else NO_NODE_WARN_S

    def _hint(self) -> str:
        nodes = self.registry.count
        if nodes:
            return f"{nodes} nodes registered"
        run = self.cfg.run.path  # `streamrl learner` and `streamrl run` write its config.toml
        command = f"streamrl rollout --config {run / 'config.toml'} --learner {run}"
        return f"no rollout node registered; start one with `{command}`"

    # ---- nodes ----------------------------------------------------------------------------------

    def serve_nodes(self) -> None:
        """Registrations, departures and lost nodes; a new node gets the current weights first. Who is in
        the run is the registry's: the publisher reports the nodes that cannot take the weights, the ledger
        those that stopped beating, and the registry moves each out."""
        for kind, node_id in self.registry.take_events():
            if kind == "joined":
                self.intake.forget_sender(node_id)  # a restarted node numbers its messages from 0
                self.registry.reset(node_id)
                self.publisher.add(node_id, self.registry.location(node_id))
                log.info("node %s joined (%d nodes)", node_id, self.registry.count)
            else:
                self.registry.leave(node_id)
        for node_id, why in self.publisher.poll():  # a failed transfer, or a version never confirmed live
            self.registry.evict(node_id, why)
            log.warning("node %s was evicted (%d nodes left)", node_id, self.registry.count)
        if time.monotonic() - self._last_reap > REAP_EVERY_S:
            self._last_reap = time.monotonic()
            for node_id, samples in self.ledger.reap_lost_nodes().items():
                log.warning(
                    "node %s stopped beating: %d in-flight samples resolved (%s)",
                    node_id,
                    samples,
                    self.cfg.ledger.on_node_lost,
                )
                ttl = self.cfg.ledger.heartbeat_ttl_s
                self.registry.lost(node_id, f"lost: no heartbeat in the ledger for {ttl:g} s (ledger.heartbeat_ttl_s)")

    # ---- commit → push → report --------------------------------------------------------------

    def commit(self, step: int, metrics: dict[str, float]) -> None:
        """The step's samples are trained (and the new version published), or, when the step took no update,
        dropped as `nonfinite_step` or `no_gradient` (no weights contain them: `trained` would claim the next
        version learned from them); and the steps left are recorded for admission."""
        ids, left = [t.sample_id for t in self.selection.train], self.steps_left(step + 1)
        dropped = {"truncated": self.selection.masked}  # in the advantages' baseline, never in the loss
        if metrics["skipped"]:
            dropped["nonfinite_step" if metrics.get("skipped_nonfinite") else "no_gradient"] = ids
            self.ledger.skip_step(dropped, steps_left=left)
        else:
            self.ledger.commit_step(ids, self.version_of(), step, steps_left=left, dropped=dropped)
            self.intake.alarm.trained()
        self.intake.counters.update({reason: len(held) for reason, held in dropped.items() if held})

    def publish(self, weights: Mapping[str, Tensor]) -> float:
        """Hand the new version to the publisher (nodes get it in the background); the seconds it held us."""
        return self.publisher.publish(self.version_of(), weights)

    def report(self, step: int, trained_by: int, metrics: dict, timings: dict[str, float], started: float) -> None:
        """One metrics record and one console line for the step, whose samples `trained_by` (the version
        the step started from) trained; the step's groups are done with."""
        selection, self.selection = self.selection, Selection()
        flat, train = [t for group in selection.groups for t in group], selection.train
        rewards = batch_stats([t.reward for t in flat], [t.group_id for t in flat])
        warn_if_flat(rewards, step, skipped=bool(metrics.get("skipped_no_gradient")))
        record = {
            **metrics,
            **{k: v for k, v in rewards.as_metrics().items() if math.isfinite(v)},  # none for a step without samples
            **selection.metrics(self.cfg.learner.groups_per_step),
            **selection.episode_figures(),
            **selection.batch_figures(trained_by, time.monotonic() - started),
            **self._time_figures(train, timings),
            **self._node_figures(),
            **{f"samples_{k}": v for k, v in self.intake.counters.items()},
            "gaps": self.intake.receiver.gaps,
            "duplicates": self.intake.receiver.duplicates,
            "decode_errors": self.intake.receiver.decode_errors + self.registry.server.decode_errors,
            **self._refusals(),
            **self.resume_figures,
        }
        self.resume_figures = {}  # in the first record of a resumed run only
        self.sink.log(step, record)
        self.events.emit("step", step=step, version=self.version_of())
        log.info(
            "step %d v%d reward %.3f±%.3f loss %.4f tokens/s %.0f mismatch_kl %.2e staleness %.2f nodes %d idle %.0f%%",
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
        if self.peak_flops and self.params:
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

    # ---- end ------------------------------------------------------------------------------------

    def close(
        self, reason: str = "run finished", finished: bool = True, ledger_reachable: bool = True, drain_s: float = 5.0
    ) -> None:
        """Tell every node to stop (`reason`) and keep taking (and discarding) what they still send until
        they said goodbye or `drain_s` passed, so no node blocks on a send to a learner that is gone; then
        the books are settled (`_settle_books`), and marked finished when the run reached its end. With
        the ledger unreachable (Redis gone past `ledger.retry_s`) it is left as it was: a resumed
        learner settles it."""
        try:
            self.heartbeat.stop()
            self.registry.stop_all(reason)
            deadline = time.monotonic() + drain_s
            while self.registry.count and time.monotonic() < deadline:
                self.intake.drain(0.05)
                for kind, node_id in self.registry.take_events():
                    if kind == "left":
                        self.registry.leave(node_id)
            if ledger_reachable:
                self._settle_books(finished)
            self.registry.close()  # and every node's weights link
            self.intake.close()
            if self.gate is not None:
                self.gate.close()
            self.sink.close()
        finally:
            if self.redis is not None:
                self.redis.stop()

    def _settle_books(self, finished: bool) -> None:
        """Resolve what the learner holds (a step cut short, samples received and never trained) and what
        nodes that are gone hold (`node_lost`: nothing will deliver it); when the run reached its end,
        mark it finished, after which anything still in flight is an error of the books."""
        try:
            if self.selection.groups:  # a step cut short (a signal mid-step): its samples were never trained
                self.ledger.drop([t.sample_id for g in self.selection.groups for t in g], "preempted")
            self.intake.drop_held("preempted")
            self.ledger.drop_received("preempted")  # e.g. a stopped node's last samples, taken in by no one
            for node_id, held in self.ledger.in_flight().held_by_gone_nodes.items():
                resolved = self.ledger.resolve_node(node_id, "node_lost")
                log.warning("node %s is gone holding %d samples: %d resolved as node_lost", node_id, held, resolved)
            if finished:
                self.ledger.finish_run()
            errors = self.ledger.check()
            if errors:
                log.error("the ledger does not balance: %s", "; ".join(errors))
        except LedgerUnavailableError as e:
            log.error("the books could not be settled: %s", e)
