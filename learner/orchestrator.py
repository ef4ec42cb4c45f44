"""Learner rank 0's orchestrator: the run's I/O around the training step, composed of three flows.

- receive → admit → pack (learner/admission.py, `Admission`): whole groups from `Intake` (admitted through
  the ledger), selected (learner/selection.py), per-rank micro-batches balanced by tokens; (every rank
  trains) → commit: `Admission` gives the step's samples back to the ledger, trained or dropped.
- push → report (learner/step_outcome.py, `StepOutcome`): the new version to the `Publisher`, one
  metrics record and console line.
- nodes (learner/node_service.py, `NodeService`), served between receives: joins get the latest weights,
  departures and lost nodes are resolved; `NodeRegistry` (learner/nodes.py) owns who is in the run.

The policy version is the trainer's (`version_of()` asks it); the orchestrator publishes it to the
ledger at each commit and hands it to every node that registers. A new part (evaluation, a critic) gets a
module of its own that these call or that reports through `StepOutcome.add_figures`, not lines here.

Faults: each learner is one incarnation of the run, announced in `RUN/learner.json` and in the ledger,
so nodes left running by a dead learner register with the next one. A resumed learner makes the
books match its checkpoint (`claim_run`); a run that trains nothing for `learner.stall_stop_s`
stops (`StallAlarm`); at the end, everything the learner or a gone node still holds is resolved and
the run is marked finished, so `streamrl status` can tell an unresolved sample from one on its way.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from streamrl.engine.auth import open_gate
from streamrl.engine.config import Config
from streamrl.engine.control import ControlServer
from streamrl.engine.ledger import open_ledger
from streamrl.engine.messages import AdapterSpec, Welcome
from streamrl.engine.telemetry import EventLog, MetricsSink
from streamrl.engine.transport import TrajectoryReceiver, bind_address
from streamrl.learner.admission import Admission, claim_run
from streamrl.learner.batching import StepBatch
from streamrl.learner.heartbeat import LearnerHeartbeat
from streamrl.learner.intake import Intake, RewardWatch, StallAlarm
from streamrl.learner.node_service import NodeService
from streamrl.learner.nodes import NodeRegistry
from streamrl.learner.overdue import OverdueGroups
from streamrl.learner.places import LostPlaces
from streamrl.learner.publisher import Publisher
from streamrl.learner.step_metrics import peak_flops
from streamrl.learner.step_outcome import StepOutcome

log = logging.getLogger("streamrl.learner")


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
        self.cfg, self.version_of = cfg, version_of
        self.incarnation = uuid.uuid4().hex[:12]
        self.ledger, self.redis = open_ledger(cfg.ledger, cfg.run.name, cfg.run.path)
        self.gate = None
        try:
            resume_figures = claim_run(self.ledger, cfg, resumed_version, first_step)
            self.redis_url = cfg.ledger.url or self.redis.url
            self._build_parts(device, adapter)
        except BaseException:
            if self.gate is not None:
                self.gate.close()
            if self.redis is not None:
                self.redis.stop()
            raise
        serve, count = self.serve_nodes, self._node_count
        self.admission = Admission(cfg, self.ledger, self.intake, version_of, serve, count, compiled)
        mfu = dict(flops_per_token=flops_per_token or 6 * params, peak_flops=peak_flops(device)) if params else {}
        self.outcome = StepOutcome(cfg, self.intake, self.registry, self.publisher, version_of,
                                   self.sink, self.events, self.gate, first_figures=resume_figures, **mfu)  # fmt: skip
        self.nodes = NodeService(cfg, self.registry, self.ledger, self.intake, self.publisher, version_of,
                                 self.redis_url, authenticated=self.gate is not None)  # fmt: skip
        self.ledger.announce_learner(self.incarnation, self.registry.addr, self.intake.addr)
        self.heartbeat = LearnerHeartbeat(self.ledger, self.incarnation)
        self.heartbeat.start()
        self.registry.start()
        self.nodes.write_address_file(cfg.run.path, self.incarnation)
        self.events.emit("up", control=self.registry.addr, trajectories=self.intake.addr)
        where = (self.registry.addr, self.intake.addr, self.redis_url.split("@")[-1], self.incarnation)
        log.info("learner up: control %s, trajectories %s, ledger %s (incarnation %s)", *where)

    def _build_parts(self, device: torch.device, adapter: AdapterSpec | None) -> None:
        """The sockets, the registry, the intake, the publisher and the sinks (undone by the caller when one
        fails to start)."""
        cfg, t = self.cfg, self.cfg.transport
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
        rewards = RewardWatch(window)
        overdue = OverdueGroups(self.ledger, self.registry.silent_s, window, self.registry.reachability.unreachable_s)
        places = LostPlaces(cfg.learner.groups_per_step)
        self.intake = Intake(receiver, self.ledger, alarm, patience, rewards, overdue, places)
        self.intake.events = self.events
        self.publisher = Publisher(cfg, self.registry, device, adapter)
        self.sink = MetricsSink(cfg.run.path, cfg.telemetry)

    def _welcome(self, node_id: str) -> Welcome:
        # the registry is built before the parts a Welcome names (the receiver and the publisher ask the
        # registry), so it asks the node service through here; it welcomes no one before `start()`
        return self.nodes.welcome(node_id)

    def _node_count(self) -> int:
        return self.registry.count  # asked at each wait: the registry's, never a copy

    # ---- the step loop's calls (learner/main.py) ------------------------------------------------

    def next_batch(self, ranks: int, step: int = 0) -> list[StepBatch]:
        """receive → admit → pack: the next step's micro-batches, one list per rank."""
        return self.admission.next_batch(ranks, step)

    def serve_nodes(self) -> None:
        """Registrations, departures and lost nodes (`NodeService.serve`), between receives."""
        self.nodes.serve()

    def commit(self, step: int, metrics: dict[str, float]) -> None:
        """The step's samples trained, or dropped when the step took no update (`Admission.commit`)."""
        self.admission.commit(step, metrics)

    def publish(self, weights: Mapping[str, Tensor]) -> float:
        """Hand the new version to the publisher (nodes get it in the background); the seconds it held us."""
        return self.outcome.publish(weights)

    def report(self, step: int, trained_by: int, metrics: dict, timings: dict[str, float], started: float) -> None:
        """One metrics record and one console line for the step; the step's groups are done with."""
        self.outcome.report(step, trained_by, metrics, timings, started, self.admission.hand_over())

    # ---- end ------------------------------------------------------------------------------------

    def close(
        self, reason: str = "run finished", finished: bool = True, ledger_reachable: bool = True, drain_s: float = 5.0
    ) -> None:
        """Tell every node to stop (`reason`) and take in what they still send for up to `drain_s`; then
        the books are settled, and marked finished when the run reached its end. With the ledger
        unreachable (Redis gone past `ledger.retry_s`) it is left as it was: a resumed learner settles it."""
        try:
            self.heartbeat.stop()
            self.nodes.stop_all(reason, drain_s)
            if ledger_reachable:
                self.admission.settle_books(finished)
            self.registry.close()  # and every node's weights link
            self.intake.close()
            if self.gate is not None:
                self.gate.close()
            self.sink.close()
        finally:
            if self.redis is not None:
                self.redis.stop()
