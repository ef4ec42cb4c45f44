"""receive → admit → pack → commit: the learner's side of admission, from the samples `Intake` holds to
each rank's micro-batches, and back to the ledger once the step trained them.

The ledger admits a group when a node takes its credit (at most what the remaining steps train,
`steps_left` x groups_per_step; in sync mode one step's worth, at the learner's current version); `Intake`
admits each sample again as it arrives (a stale one is dropped there). `Admission` takes a step's whole
groups from `Intake`, lets learner/selection.py decide what the step trains (overlong penalty, dynamic
sampling, truncated completions masked), and packs the kept samples per rank, balanced by tokens. It holds
the step's `Selection` until the step is reported (`hand_over`). `commit` closes what the step opened:
its samples `trained` (or dropped when the step took no update), the masked ones dropped with it (no
credit returns before the step is done), and the steps left written, which bounds what the ledger admits
next. At the end, `settle_books` resolves whatever is still held.

`claim_run` opens the run's admission in the ledger when the learner starts; a resumed learner makes the
books match its checkpoint first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from streamrl.engine.config import Config, ConfigError
from streamrl.engine.config.presets import completion_limit
from streamrl.engine.ledger import Ledger, LedgerUnavailableError
from streamrl.engine.messages import Trajectory
from streamrl.learner.batching import StepBatch, pack_for_ranks
from streamrl.learner.intake import NO_NODE_WARN_S, WAITING_WARN_S, Intake
from streamrl.learner.selection import Selection, select, warn_unfilled

log = logging.getLogger("streamrl.learner")


def steps_left(cfg: Config, next_step: int) -> int:
    """Steps still to train from `next_step` on: the ledger admits no group beyond what they train."""
    return max(0, cfg.run.steps - next_step + 1)


class Admission:
    """The step's samples: taken from `Intake` in admission order, selected, packed per rank, committed.

    `serve` runs between receives (the node service: joins get weights while the learner waits);
    `node_count` says how many nodes are in the run (the registry's), for what a long wait says."""

    def __init__(
        self,
        cfg: Config,
        ledger: Ledger,
        intake: Intake,
        version_of: Callable[[], int],
        serve: Callable[[], None],
        node_count: Callable[[], int],
        compiled: bool = False,
    ):
        self.cfg, self.ledger, self.intake, self.version_of = cfg, ledger, intake, version_of
        self.serve, self.node_count, self.compiled = serve, node_count, compiled
        self.selection = Selection()  # the step's groups and what it trains of them, until reported

    def next_batch(self, ranks: int, step: int = 0) -> list[StepBatch]:
        """The next step's samples (learner/selection.py: overlong penalty, dynamic sampling, truncated
        completions masked), as each rank's micro-batches (balanced by tokens)."""
        version, learner = self.version_of(), self.cfg.learner

        takes = 0

        def take(n: int, holding: set[str]) -> list[list[Trajectory]]:
            nonlocal takes
            takes += 1  # a second take is a refill: select counted the places given up already
            return self.intake.collect(
                n, version, self.serve, self.hint, holding=holding, warn_after=self.warn_after, refill=takes > 1
            )

        places, wanted = self.intake.places, learner.groups_per_step  # given up groups' places: learner/places.py
        short = lambda: places.short  # noqa: E731 (groups given up while the step waits count too)
        self.selection = select(take, self.drop, wanted, self.cfg.loss, completion_limit(self.cfg), short)
        warn_unfilled(step, self.selection, wanted - places.short, self.cfg.loss)
        train = self.selection.train
        pad = learner.micro_batch_tokens // learner.pad_buckets if self.compiled and learner.pad_buckets else 0
        per_rank = pack_for_ranks(train, self.selection.advantages, ranks, learner.micro_batch_tokens, pad_multiple=pad)
        return [StepBatch(mbs, version, sum(t.model_tokens for t in train)) for mbs in per_rank]

    def drop(self, sample_ids: list[str], reason: str) -> None:
        """Samples the step leaves out (zero_variance, truncated): resolved, counted as samples_<reason>."""
        self.ledger.drop(sample_ids, reason)
        self.intake.counters.update({reason: len(sample_ids)})

    def commit(self, step: int, metrics: Mapping[str, float]) -> None:
        """The step's samples are trained (and the new version published), or, when the step took no update,
        dropped as `nonfinite_step` or `no_gradient` (no weights contain them: `trained` would claim the next
        version learned from them); and the steps left are recorded for admission."""
        ids, left = [t.sample_id for t in self.selection.train], steps_left(self.cfg, step + 1)
        dropped = {"truncated": self.selection.masked}  # in the advantages' baseline, never in the loss
        held = self.intake.places.step_done()  # the places its lost groups left end with it
        if metrics["skipped"]:
            dropped["nonfinite_step" if metrics.get("skipped_nonfinite") else "no_gradient"] = ids
            self.ledger.skip_step(dropped, steps_left=left, held=held)
        else:
            self.ledger.commit_step(ids, self.version_of(), step, steps_left=left, dropped=dropped, held=held)
            self.intake.alarm.trained()
        self.intake.counters.update({reason: len(held) for reason, held in dropped.items() if held})

    def hand_over(self) -> Selection:
        """The step's selection, for its report; the next step starts from none."""
        selection, self.selection = self.selection, Selection()
        return selection

    def settle_books(self, finished: bool) -> None:
        """Resolve what the learner holds (a step cut short, samples received and never trained)
        and what nodes that are gone hold (`node_lost`: nothing will deliver it); when the run reached its
        end, mark it finished, after which anything still in flight is an error of the books."""
        try:
            if self.selection.groups:  # a step cut short (a signal mid-step): its samples were never trained
                self.ledger.drop([t.sample_id for g in self.selection.groups for t in g], "preempted")
            self.intake.drop_held("preempted")
            self.ledger.drop_received("preempted")  # e.g. a stopped node's last samples, taken in by no one
            for node_id, gone in self.ledger.in_flight().held_by_gone_nodes.items():
                resolved = self.ledger.resolve_node(node_id, "node_lost")
                log.warning("node %s is gone holding %d samples: %d resolved as node_lost", node_id, gone, resolved)
            if finished:
                self.ledger.finish_run()
            errors = self.ledger.check()
            if errors:
                log.error("the ledger does not balance: %s", "; ".join(errors))
        except LedgerUnavailableError as e:
            log.error("the books could not be settled: %s", e)

    def warn_after(self) -> float:
        return WAITING_WARN_S if self.node_count() else NO_NODE_WARN_S

    def hint(self) -> str:
        """What a long wait for samples waits on: the nodes in the run, or how to start the first."""
        nodes = self.node_count()
        if nodes:
            return f"{nodes} nodes registered"
        run = self.cfg.run.path  # `streamrl learner` and `streamrl run` write its config.toml
        command = f"streamrl rollout --config {run / 'config.toml'} --learner {run}"
        return f"no rollout node registered; start one with `{command}`"


def claim_run(ledger: Ledger, cfg: Config, resumed_version: int | None, first_step: int) -> dict[str, int]:
    """Open the run's admission in the ledger (`init_run`). A fresh learner refuses a run that already
    trained (it would continue its versions with fresh weights). A learner resumed from a checkpoint of
    policy `resumed_version` makes the books match it: what its predecessor took in but never trained is
    dropped as `preempted`, and the samples trained in steps the checkpoint does not contain become
    `rolled_back` (the version goes back to the checkpoint's). The figures go into the first metrics
    record of the resumed run."""
    ledger_version = ledger.current_version()
    if resumed_version is None and ledger_version > 0:
        raise ConfigError(
            f"run {cfg.run.name!r} already trained to version {ledger_version} (its "
            "ledger says so): pass --resume latest to continue it, set run.name to start a new run, or start "
            "this one again with `streamrl run --fresh` (its earlier books kept in RUN/earlier/)"
        )
    if resumed_version is not None and resumed_version > ledger_version:
        raise ConfigError(
            f"the checkpoint is of version {resumed_version} but run {cfg.run.name!r}'s ledger is at "
            f"version {ledger_version}: they are not of one run (another run's checkpoint, or a ledger.url "
            "that does not hold this run's books); resume with the run's own ledger and checkpoints"
        )
    ledger.init_run(cfg.learner.groups_per_step, cfg.run.mode, steps_left(cfg, first_step))
    if resumed_version is None:
        return {}
    preempted = ledger.drop_received("preempted")
    rolled_back = ledger.roll_back(resumed_version) if ledger_version > resumed_version else 0
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
