"""`streamrl learner`: receive → admit → step → broadcast, one optimizer step per batch of groups.

Every rank runs this file (torchrun for more than one); rank 0 alone owns the sockets, the ledger,
the metrics and the console. The batch travels from rank 0 to the other ranks once per step; each
rank trains on its share and the step's normaliser is global, so the update does not depend on
how many ranks there are.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time

import torch
import torch.distributed as dist

from streamrl.engine.config import Config, ConfigError, load
from streamrl.engine.messages import Trajectory, decode_trajectory, encode
from streamrl.engine.models import default_tiny_model, load_model
from streamrl.engine.telemetry import MetricsSink, setup_logging
from streamrl.learner import checkpoint, parallel
from streamrl.learner.advantages import group_advantages
from streamrl.learner.batching import pack
from streamrl.learner.train_step import Trainer
from streamrl.rewards.stats import RewardStats, batch_stats, warn_if_flat

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


def share_batch(groups: list[list[Trajectory]] | None, cfg: Config) -> tuple[list[Trajectory], list[float], int]:
    """Rank 0's groups → (this rank's samples, their advantages, loss tokens of the whole step)."""
    payload = None
    if parallel.is_rank0():
        rewards = [[t.reward for t in group] for group in groups]
        advantages, _ = group_advantages(rewards, cfg.loss.advantage)
        flat = [t for group in groups for t in group]
        payload = (
            [encode(t) for t in flat],
            [a for row in advantages for a in row],
            sum(len(t.completion_ids) for t in flat),
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        payload = box[0]
    frames, advantages, total_tokens = payload
    rank = parallel.rank()
    return [decode_trajectory(f) for f in frames[rank::world]], advantages[rank::world], total_tokens


def batch_metrics(flat: list[Trajectory], stats: RewardStats, version: int, seconds: float) -> dict[str, float]:
    """The step's batch figures: reward statistics, tokens, throughput and staleness against `version`."""
    tokens = sum(len(t.completion_ids) for t in flat)
    lags = [version - t.min_version for t in flat]
    return {
        **stats.as_metrics(),
        "samples": len(flat),
        "completion_tokens": tokens,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "staleness_mean": sum(lags) / len(lags),
        "staleness_max": max(lags),
    }


def run_learner(cfg: Config, resume: str = "") -> int:
    device = parallel.init_distributed()
    rank0 = parallel.is_rank0()
    setup_logging(cfg.run.path, f"learner-rank{parallel.rank()}", console=rank0, level=cfg.telemetry.log_level)
    torch.manual_seed(cfg.run.seed)
    model_path = cfg.model.path or str(default_tiny_model())
    model = load_model(model_path, "float32", "cpu", cfg.model.trust_remote_code)
    policy = parallel.wrap_model(model, cfg.learner, device, temperature=cfg.rollout.temperature)
    # every step ends in a full state dict for the broadcast, which reshards the model: a gather ahead
    # would be thrown away (the broadcast could read the gathered bf16 copy instead; not done yet)
    trainer = Trainer(policy, cfg.loss, cfg.learner, device, gather_ahead=False)
    keeper = checkpoint.Keeper(cfg.checkpoint, cfg.run.path, policy.lm, trainer, model_path, cfg.run.steps)
    first = keeper.resume(resume, cfg.run.path).step + 1 if resume else 1
    side = RankZero(cfg, device, resumed=bool(resume)) if rank0 else None
    align_version(trainer, policy, side, device, resumed=bool(resume))
    try:
        for step in range(first, cfg.run.steps + 1):
            started = time.monotonic()
            groups = side.collect() if rank0 else None  # receive → admit
            samples, advantages, total_tokens = share_batch(groups, cfg)
            metrics = trainer.step(pack(samples, advantages, cfg.learner.micro_batch_tokens), total_tokens)  # step
            state = parallel.full_state_dict(policy)
            if rank0:
                side.publish(groups, state, trainer.version, step, metrics, started)  # commit → broadcast
            keeper.after_step(step, state)  # checkpoint
    finally:
        if side is not None:
            side.close()
        parallel.shutdown()
    return 0


def align_version(trainer: Trainer, policy, side: RankZero | None, device: torch.device, resumed: bool) -> None:
    """Continue at the ledger's version when it is ahead (steps trained after the checkpoint were
    lost with the learner, their samples stay trained); a resumed learner hands joining nodes its
    restored weights first."""
    mine = max(trainer.version, side.hub.version) if side is not None else trainer.version
    trainer.version = parallel.max_over_ranks(mine, device)
    weights = parallel.full_state_dict(policy) if resumed else None
    if side is not None:
        side.hub.version = side.hub.welcome.policy_version = trainer.version
        if resumed:
            side.hub.latest_state = weights


class RankZero:
    """What only rank 0 does each step: the hub (sockets, ledger, weights) and the metrics."""

    def __init__(self, cfg: Config, device: torch.device, resumed: bool = False):
        from streamrl.engine.ledger import open_ledger
        from streamrl.learner.hub import Hub

        self.cfg = cfg
        self.ledger, self.redis = open_ledger(cfg.ledger, cfg.run.name, cfg.run.path)
        if not resumed and self.ledger.current_version() > 0:
            version = self.ledger.current_version()
            if self.redis is not None:
                self.redis.stop()
            raise ConfigError(
                f"run {cfg.run.name!r} already trained to version {version} (its ledger says so): "
                "pass --resume latest to continue it, or set run.name to start a new run"
            )
        self.ledger.init_run(cfg.learner.groups_per_step)
        if resumed:  # what the previous learner took in but never trained will not come again
            log.info(
                "resuming: %d samples received but not trained before are dropped as preempted",
                checkpoint.preempt_received(self.ledger),
            )
        url = cfg.ledger.url or self.redis.url
        self.hub = Hub(cfg, self.ledger, url, device, version=self.ledger.current_version())
        self.hub.write_address_file(cfg.run.path)
        self.pending: list[list[Trajectory]] = []  # the step's groups until committed
        self.sink = MetricsSink(cfg.run.path, cfg.telemetry.tensorboard, cfg.telemetry.prometheus_port)
        log.info(
            "learner up: control %s, trajectories %s, ledger %s",
            self.hub.control_addr,
            self.hub.receiver.addr,
            url.split("@")[-1],
        )

    def collect(self) -> list[list[Trajectory]]:
        self.pending = self.hub.collect(self.cfg.learner.groups_per_step)
        return self.pending

    def publish(self, groups, state, version: int, step: int, metrics: dict, started: float) -> None:
        flat = [t for group in groups for t in group]
        trained_by = self.hub.version  # the policy the step started from: staleness is measured against it
        if metrics["skipped"]:
            self.ledger.drop([t.sample_id for t in flat], "nonfinite_step")
        else:
            self.hub.commit(groups, version, step)
        self.pending = []
        results = self.hub.broadcast(state, version) if not metrics["skipped"] else {}
        rewards = batch_stats([t.reward for t in flat], [t.group_id for t in flat])
        warn_if_flat(rewards, step)
        record = {
            **metrics,
            **batch_metrics(flat, rewards, trained_by, time.monotonic() - started),
            "nodes": self.hub.nodes_alive(),
            "weights_s": max((r.seconds for r in results.values()), default=0.0),
            "evicted": sum(not r.ok for r in results.values()),
            **{f"samples_{k}": v for k, v in self.hub.counters.items()},
            "gaps": self.hub.receiver.gaps,
            "duplicates": self.hub.receiver.duplicates,
        }
        self.sink.log(step, record)
        log.info(
            "step %d v%d reward %.3f±%.3f loss %.4f tokens/s %.0f mismatch_kl %.2e staleness %.2f nodes %d",
            step,
            version,
            record["reward/mean"],
            record["reward/std"],
            record["loss"],
            record["tokens_per_s"],
            record.get("mismatch_kl", float("nan")),
            record["staleness_mean"],
            record["nodes"],
        )

    def close(self) -> None:
        if self.pending:  # a step cut short (a signal mid-step): its samples were never trained
            self.ledger.drop([t.sample_id for group in self.pending for t in group], "preempted")
        self.hub.close()
        self.sink.close()
        errors = self.ledger.check()
        if errors:
            log.error("the ledger does not balance: %s", "; ".join(errors))
        if self.redis is not None:
            self.redis.stop()


def _terminate_gracefully(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m streamrl.learner.main", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="TOML config file (defaults when omitted)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override")
    parser.add_argument(
        "--resume",
        default="",
        metavar="PATH|latest",
        help="continue from a checkpoint (a step folder, or latest in the run folder)",
    )
    args = parser.parse_args(argv)
    try:
        cfg = load(args.config, args.set)
        check_config(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _terminate_gracefully)
    try:
        return run_learner(cfg, args.resume)
    except KeyboardInterrupt:
        log.warning("learner stopped by a signal")
        return 130
    except (ConfigError, checkpoint.CheckpointError) as e:
        log.error("%s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
