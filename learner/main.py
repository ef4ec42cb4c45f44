"""`streamrl learner`: receive → admit → step → commit → push → report → checkpoint, once per step.

Every rank runs this loop (torchrun for more than one). Rank 0's `Orchestrator` does the I/O: it
collects the step's groups, packs each rank's micro-batches (balanced by tokens) and sends them as
tensors; every rank trains on its share with the step's global normaliser, so the update does not
depend on how many ranks there are. The policy version is the trainer's: it moves once per
successful step, and rank 0 publishes it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch

from streamrl.engine.config import Config, ConfigError, presets
from streamrl.engine.config import rules as config_rules
from streamrl.engine.ledger import LedgerUnavailableError, LedgerUnwritableError
from streamrl.engine.messages import AdapterSpec
from streamrl.engine.models import default_tiny_model, load_model
from streamrl.engine.telemetry import ENDING, keep_reserve, setup_logging, write_ending
from streamrl.learner import checkpoint, evaluation, lora, parallel, step_scatter
from streamrl.learner.clean_stop import CleanStop
from streamrl.learner.critic.trainer import build_shaper
from streamrl.learner.intake import LearnerStalledError, RewardFailingError
from streamrl.learner.orchestrator import Orchestrator
from streamrl.learner.reference import build_reference
from streamrl.learner.train_step import Trainer

log = logging.getLogger("streamrl.learner")


def check_config(cfg: Config) -> None:
    """Refuse combinations the learner cannot run, naming the fields (engine/config/rules.py, as preflight)."""
    for finding in config_rules.require(cfg, roles=("learner",)):
        log.warning("%s", finding.message)


def run_learner(cfg: Config, resume: str = "") -> str:
    """Train to `run.steps`; what was trained, in words (RUN/end.json's detail of a finished run)."""
    device = parallel.init_distributed()
    rank0 = parallel.is_rank0()
    _start_logging(cfg, rank0)
    torch.manual_seed(cfg.run.seed)
    policy, adapter, compute, model_path = _policy(cfg, device)
    reference = build_reference(cfg, device, compute, policy)  # None unless a KL needs it
    trainer = _trainer(cfg, policy, device, reference, compute)
    keeper = checkpoint.Keeper(cfg.checkpoint, cfg.run.path, policy.lm, trainer, model_path, cfg.run.steps, adapter)
    first = keeper.resume(resume, cfg.run.path).step + 1 if resume else 1  # steps continue from the checkpoint
    resumed_version = trainer.version if resume else None  # the ledger is rolled back to it
    orchestrator = _start_orchestrator(cfg, device, trainer, policy, resumed_version, first, adapter)
    evaluations = evaluation.start(cfg, orchestrator, trainer.version, first) if rank0 else None  # v0's posted
    ending = {"reason": "the learner stopped", "finished": False, "ledger_reachable": True}
    stop = CleanStop(done_step=first - 1)  # Ctrl-C and SIGTERM from here: learner/clean_stop.py
    stop.install()
    skips = 0  # steps that took no optimizer update (no gradient, or a non-finite one): they trained nothing
    try:
        push_weights = parallel.PushWeights(policy, compute, adapters=adapter is not None)
        _hand_restored_weights(trainer, orchestrator, push_weights)
        loop = _Loop(cfg, device, trainer, policy, keeper, orchestrator, evaluations, stop, push_weights)
        # compiled while the nodes start, except where a node's start must find the GPU's room free (sync mode)
        if parallel.compiles(cfg.learner, device) and cfg.simulate.train_s <= 0 and not loop.release:
            log.info("learner compiled ahead of step 1 in %.1f s", trainer.warm_up())
        for step in range(first, cfg.run.steps + 1):
            skips += loop.step(step)
        ending.update(reason="run finished", finished=True)
    except KeyboardInterrupt:
        keeper.save_on_stop(stop.done_step)  # resumable from where it stopped (a second signal cuts it short)
        raise
    except (LedgerUnavailableError, RewardFailingError, LearnerStalledError) as e:
        ending.update(_ending_of(e))
        raise
    finally:
        if orchestrator is not None:
            orchestrator.close(**ending)
        parallel.shutdown()
    ran = cfg.run.steps - first + 1
    return f"{ran} steps: {ran - skips} trained, {skips} skipped (no update)" + (
        f", from step {first}" if first > 1 else ""
    )


def _start_logging(cfg: Config, rank0: bool) -> None:
    """Rank 0 logs to the console and says where the run's files are; every rank to its own log file."""
    setup_logging(cfg.run.path, f"learner-rank{parallel.rank()}", console=rank0, level=cfg.telemetry.log_level)
    if not rank0:
        return
    (cfg.run.path / ENDING).unlink(missing_ok=True)  # running again (a resume): not ended
    keep_reserve(cfg.run.path)  # room for the last words on a disk that fills up
    where = cfg.run.path  # with no terminal (a log, nohup, Slurm) a step is one line; these hold the rest
    log.info("run %s: folder %s, metrics %s, logs %s", cfg.run.name, where, where / "metrics.jsonl", where / "logs")
    log.info("%s", presets.describe(cfg))  # every field a recipe set, and which an explicit setting overrode


def _policy(cfg: Config, device: torch.device):
    """The policy wrapped for the ranks, LoRA's adapter spec (None without), the compute dtype, the model's folder."""
    model_path = cfg.model.path or str(default_tiny_model())
    compute = getattr(torch, cfg.model.dtype)  # the learner's compute dtype = what the engines serve
    # fp32 master weights; LoRA: a frozen base in the compute dtype (read as such: half the host memory and
    # time for a bf16 model), fp32 adapters (learner/lora.py)
    master = cfg.model.dtype if cfg.lora.enabled else "float32"
    model = load_model(model_path, master, "cpu", cfg.model.trust_remote_code)
    adapter = None
    if cfg.lora.enabled:
        model, adapter = lora.apply(model, cfg.lora, compute)
    sampling = dict(temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p)
    policy = parallel.wrap_model(model, cfg.learner, device, compute_dtype=compute, **sampling)
    return policy, adapter, compute, model_path


def _ending_of(error: Exception) -> dict:
    """How a run that `error` stopped ended (the orchestrator's close settles the books by it)."""
    if isinstance(error, LedgerUnavailableError):
        why = "refuses writes" if isinstance(error, LedgerUnwritableError) else "is unreachable"
        return {"reason": f"the ledger (Redis) {why}", "ledger_reachable": False}
    if isinstance(error, RewardFailingError):
        return {"reason": "the reward fails on (nearly) every sample"}
    return {"reason": "nothing was trained for learner.stall_stop_s"}


class _Loop:
    """One step of the loop on every rank: receive → admit → step → commit → push → report → checkpoint (rank 0
    does the I/O: its orchestrator and evaluations are None on the other ranks)."""

    def __init__(self, cfg: Config, device, trainer, policy, keeper, orchestrator, evaluations, stop, push_weights):
        self.cfg, self.device, self.trainer, self.policy, self.keeper = cfg, device, trainer, policy, keeper
        self.orchestrator, self.evaluations, self.stop = orchestrator, evaluations, stop
        self.push_weights = push_weights
        # sync mode on a GPU: a step's freed activations go back to the driver, for nodes waking on this GPU
        self.release = cfg.run.mode == "sync" and torch.device(device).type == "cuda"
        self.saved_s = 0.0  # the previous step's checkpoint time (reported with the next step)

    def step(self, step: int) -> bool:
        """Train step `step`; whether it took no update (skipped)."""
        clock, rank0, last = _Laps(), self.orchestrator is not None, step == self.cfg.run.steps
        per_rank = self.orchestrator.next_batch(parallel.world_size(), step) if rank0 else None  # receive → admit
        clock.lap("wait_s")
        batch = step_scatter.scatter_step(per_rank, self.device)
        self.stop.hold()  # a signal waits for the update and its commit: a clean stop saves a state that agrees
        metrics = self.trainer.step(batch.micro_batches, batch.loss_tokens)  # step
        if self.release:
            torch.cuda.empty_cache()
        clock.lap("train_s")
        skipped = bool(metrics["skipped"])
        if rank0:
            self.orchestrator.commit(step, metrics)  # commit
        self.stop.release(step)
        clock.lap("commit_s")
        weights = self.push_weights() if not skipped else None  # on the device
        if rank0:
            self.evaluations.before_publish(self.trainer.version, step, last=last)  # before it goes live
            if weights is not None:
                self.orchestrator.publish(weights)  # push: nodes receive it in the background
        clock.lap("push_s")
        if rank0:  # report before the checkpoint: a learner killed in the save leaves its step's record
            metrics = {**metrics, **self.evaluations.figures(last=last)}  # the last: waited for
            laps = {**clock.laps, "checkpoint_s": self.saved_s}  # the previous step's save
            self.orchestrator.report(step, batch.version, metrics, laps, clock.started)  # report
        clock.lap("report_s")
        self.keeper.after_step(step, self.policy)  # checkpoint
        self.saved_s = clock.lap("checkpoint_s")
        return skipped


def _trainer(cfg: Config, policy, device: torch.device, reference, compute: torch.dtype) -> Trainer:
    """The trainer; with `simulate.train_s` one that sleeps instead (benchmarks of the scheduler)."""
    # gather ahead: each step ends with the next forward's weights gathered, which the push reads too
    if cfg.simulate.train_s > 0:
        from streamrl.learner.simulate import SimulatedTrainer

        return SimulatedTrainer(policy, cfg.loss, cfg.learner, device, simulate=cfg.simulate, seed=cfg.run.seed)
    shaper = build_shaper(cfg, device, compute, reference)  # GAE's critic, REINFORCE++ (learner/critic/)
    return Trainer(policy, cfg.loss, cfg.learner, device, ref_model=reference, gather_ahead=True, shaper=shaper)


def _critic_flops(cfg: Config, trainer: Trainer) -> int:
    """The critic's FLOPs a token, for the MFU: its values for GAE (a forward: 2 a parameter) and each of its
    passes (critic.epochs, else learner.epochs: 6 a trained parameter, 4 a frozen one of a LoRA critic's base:
    forward and input gradients). 0 without a critic."""
    critic = trainer.shaper.model if trainer.shaper is not None else None
    if critic is None:
        return 0
    params = sum(p.numel() for p in critic.parameters())
    trained = sum(p.numel() for p in critic.parameters() if p.requires_grad)
    return 2 * params + (cfg.critic.epochs or cfg.learner.epochs) * (4 * (params - trained) + 6 * trained)


class _Laps:
    """Seconds between named points of one step (time.monotonic)."""

    def __init__(self) -> None:
        self.started = self._last = time.monotonic()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> float:
        now = time.monotonic()
        self.laps[name] = now - self._last
        self._last = now
        return self.laps[name]


def _start_orchestrator(
    cfg: Config,
    device: torch.device,
    trainer: Trainer,
    policy,
    resumed_version: int | None,
    first_step: int,
    adapter: AdapterSpec | None = None,
):
    """Rank 0's orchestrator; a refusal (a run trained already, ...) stops every rank, not rank 0 alone."""
    orchestrator, error = None, None
    if parallel.is_rank0():
        compiled = parallel.compiles(cfg.learner, device)
        params = sum(p.numel() for p in policy.lm.parameters())
        trained = sum(p.numel() for p in policy.lm.parameters() if p.requires_grad)
        # a frozen base costs forward + input gradients (4 FLOPs a parameter a token), the trained ones 6
        flops = 4 * (params - trained) + 6 * trained + _critic_flops(cfg, trainer)
        try:
            orchestrator = Orchestrator(
                cfg,
                device,
                lambda: trainer.version,
                resumed_version=resumed_version,
                compiled=compiled,
                params=params,
                first_step=first_step,
                adapter=adapter,
                flops_per_token=flops,
            )
        except ConfigError as e:
            error = str(e)
    error = parallel.from_rank0(error)
    if error:
        raise ConfigError(error)
    return orchestrator


def _hand_restored_weights(
    trainer: Trainer, orchestrator: Orchestrator | None, push_weights: parallel.PushWeights
) -> None:
    """A resumed learner hands joining nodes its restored weights. The ledger's version is the
    trainer's by now: the orchestrator refused a ledger behind the checkpoint and rolled back one ahead."""
    if trainer.version > 0:
        weights = push_weights()
        if orchestrator is not None:
            orchestrator.publisher.publish(trainer.version, weights)


def _terminate_gracefully(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(cfg: Config, resume: str = "") -> int:
    """The learner process: the exit status (2 for a config or checkpoint error, 3 when nothing was
    trained for `learner.stall_stop_s` or the reward failed on nearly every sample of 2 steps, 4 when
    the ledger's Redis stayed unreachable past `ledger.retry_s`, 5 when it refused writes that long (its
    disk full: MISCONF; OOM; READONLY), 130 on a signal), also written with
    how the run ended to RUN/end.json (`streamrl status` shows it)."""
    try:
        check_config(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, _terminate_gracefully)
    code, ended, detail = _run(cfg, resume)
    if os.environ.get("RANK", "0") == "0" and cfg.run.path.is_dir():  # rank 0 speaks for the run
        if not write_ending(cfg.run.path, ended, code, detail):
            log.error("how the run ended could not be written to %s", cfg.run.path / ENDING)
    return code


def _run(cfg: Config, resume: str) -> tuple[int, str, str]:
    """The learner's exit status, how the run ended (RUN/end.json's `ended`) and what ended it."""
    try:
        return 0, "finished", run_learner(cfg, resume)
    except KeyboardInterrupt as e:
        log.warning("learner stopped by a signal")
        return 130, "interrupted", f"stopped by {e}"
    except (ConfigError, checkpoint.CheckpointError) as e:
        log.error("%s", e)
        return 2, "stopped by an error", str(e)
    except RewardFailingError as e:
        log.error("the run stops: %s", e)
        return 3, "stopped: the reward fails", str(e)
    except LearnerStalledError as e:
        log.error("the run stalled: %s", e)
        return 3, "stopped by the stall alarm", str(e)
    except LedgerUnwritableError as e:
        log.error("the learner stops: %s", e)
        return 5, "stopped: the ledger cannot write", f"Redis refused writes: {e.refusal}\n{e}"
    except LedgerUnavailableError as e:
        log.error("the learner stops: %s", e)
        return 4, "ledger lost", str(e)
