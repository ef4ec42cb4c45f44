"""`streamrl learner`: receive → admit → step → commit → push → checkpoint → report, once per step.

Every rank runs this loop (torchrun for more than one). Rank 0's `Orchestrator` does the I/O: it
collects the step's groups, packs each rank's micro-batches (balanced by tokens) and sends them as
tensors; every rank trains on its share with the step's global normaliser, so the update does not
depend on how many ranks there are. The policy version is the trainer's: it moves once per
successful step, and rank 0 publishes it.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

import torch

from streamrl.engine.config import Config, ConfigError
from streamrl.engine.models import default_tiny_model, load_model
from streamrl.engine.telemetry import setup_logging
from streamrl.learner import checkpoint, parallel
from streamrl.learner.orchestrator import Orchestrator
from streamrl.learner.train_step import Trainer

log = logging.getLogger("streamrl.learner")


def check_config(cfg: Config) -> None:
    """Refuse combinations the learner cannot run, naming the fields."""
    if cfg.ledger.on_node_lost == "readmit":
        raise ConfigError(
            "ledger.on_node_lost = 'readmit': rollout nodes do not yet re-generate a lost node's "
            "groups, so their credits would never return; use 'drop'"
        )
    samples = cfg.learner.groups_per_step * cfg.rollout.group_size
    if cfg.learner.ranks > samples:
        raise ConfigError(
            f"learner.ranks = {cfg.learner.ranks} exceeds the samples of a step "
            f"(learner.groups_per_step × rollout.group_size = {samples}): some ranks would idle"
        )


def run_learner(cfg: Config, resume: str = "") -> int:
    device = parallel.init_distributed()
    rank0 = parallel.is_rank0()
    setup_logging(cfg.run.path, f"learner-rank{parallel.rank()}", console=rank0, level=cfg.telemetry.log_level)
    torch.manual_seed(cfg.run.seed)
    model_path = cfg.model.path or str(default_tiny_model())
    model = load_model(model_path, "float32", "cpu", cfg.model.trust_remote_code)
    policy = parallel.wrap_model(model, cfg.learner, device, temperature=cfg.rollout.temperature)
    # every step ends in a full state dict for the push, which reshards the model: a gather ahead
    # would be thrown away
    trainer = Trainer(policy, cfg.loss, cfg.learner, device, gather_ahead=False)
    keeper = checkpoint.Keeper(cfg.checkpoint, cfg.run.path, policy.lm, trainer, model_path, cfg.run.steps)
    first = keeper.resume(resume, cfg.run.path).step + 1 if resume else 1
    orchestrator = _start_orchestrator(cfg, device, trainer, resumed=bool(resume))
    try:
        _continue_versions(trainer, orchestrator, policy)
        for step in range(first, cfg.run.steps + 1):
            started = time.monotonic()
            per_rank = orchestrator.next_batch(parallel.world_size()) if rank0 else None  # receive → admit
            batch = parallel.scatter_step(per_rank, device)
            metrics = trainer.step(batch.micro_batches, batch.loss_tokens)  # step
            state = parallel.full_state_dict(policy)
            pushed = {}
            if rank0:
                orchestrator.commit(step, skipped=bool(metrics["skipped"]))  # commit
                pushed = orchestrator.push(state) if not metrics["skipped"] else {}  # push
            keeper.after_step(step, state)  # checkpoint
            if rank0:
                orchestrator.report(step, batch.version, metrics, pushed, started)  # report
    finally:
        if orchestrator is not None:
            orchestrator.close()
        parallel.shutdown()
    return 0


def _start_orchestrator(cfg: Config, device: torch.device, trainer: Trainer, resumed: bool) -> Orchestrator | None:
    """Rank 0's orchestrator; a refusal (a run trained already, ...) stops every rank, not rank 0 alone."""
    orchestrator, error = None, None
    if parallel.is_rank0():
        try:
            orchestrator = Orchestrator(cfg, device, lambda: trainer.version, resumed=resumed)
        except ConfigError as e:
            error = str(e)
    error = parallel.from_rank0(error)
    if error:
        raise ConfigError(error)
    return orchestrator


def _continue_versions(trainer: Trainer, orchestrator: Orchestrator | None, policy) -> None:
    """Continue at the ledger's version when it is ahead of the weights (steps trained after the last
    checkpoint were lost with the learner); a resumed learner hands joining nodes its restored weights."""
    ledger_version = orchestrator.ledger_version if orchestrator is not None else 0
    trainer.version = parallel.from_rank0(max(trainer.version, ledger_version))
    if trainer.version > 0:
        state = parallel.full_state_dict(policy)
        if orchestrator is not None:
            orchestrator.publisher.latest = (trainer.version, state)


def _terminate_gracefully(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(cfg: Config, resume: str = "") -> int:
    """The learner process: the exit status (2 for a config or checkpoint error, 130 on a signal)."""
    try:
        check_config(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, _terminate_gracefully)
    try:
        return run_learner(cfg, resume)
    except KeyboardInterrupt:
        log.warning("learner stopped by a signal")
        return 130
    except (ConfigError, checkpoint.CheckpointError) as e:
        log.error("%s", e)
        return 2
