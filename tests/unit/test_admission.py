"""The learner's admission (learner/admission.py) through its real `next_batch` and `commit`, without a
learner or a model: a real ledger (the session's Redis), a real `Intake` on a real ZMQ socket, and a
stand-in node that takes credits and sends groups. Dynamic sampling keeps every step's groups and drops
the flat ones in the books, which balance to the sample; a step that cannot fill within the refill bound
trains what it has; sync mode trains every step on the learner's current version, where async runs a
step ahead; a skipped step's samples are dropped, never trained. (tests/integration/test_short_run.py
runs the same in a whole `streamrl run`.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import Trajectory
from streamrl.engine.redis_server import connect
from streamrl.engine.transport import TrajectoryReceiver, TrajectorySender
from streamrl.learner.admission import Admission, claim_run
from streamrl.learner.intake import Intake, StallAlarm

GROUP_SIZE, PER_STEP, STEPS = 4, 2, 3


class FakeNode(threading.Thread):
    """Stands in for a rollout node (rollout/node.py) without an engine: takes a credit at the ledger's
    current version (a node that always holds the newest weights), marks the group generated and sends it
    over real ZMQ. Group i's rewards: `rewards(i)`."""

    def __init__(self, ledger: Ledger, addr: str, rewards: Callable[[int], list[float]]):
        super().__init__(daemon=True)
        self.ledger, self.addr, self.rewards = ledger, addr, rewards
        self.stop, self.admitted = threading.Event(), 0

    def run(self) -> None:
        with TrajectorySender(self.addr, "n", send_timeout_s=10) as sender:
            while not self.stop.is_set():
                self.ledger.heartbeat("n")
                version = self.ledger.current_version()
                ids = self.ledger.take_credit("n", f"g{self.admitted}", GROUP_SIZE, node_version=version)
                if ids is None:
                    time.sleep(0.01)
                    continue
                rewards = self.rewards(self.admitted)
                self.admitted += 1
                group = [
                    Trajectory(sample_id=sid, group_id=sid.split(":")[0], node_id="n", seq=0, prompt_ids=[3, 4],
                               completion_ids=[10, 11], behavior_logprobs=[-1.0, -1.0], reward=r,
                               policy_version=version, group_size=GROUP_SIZE, finish_reason="stop")
                    for sid, r in zip(ids, rewards)
                ]  # fmt: skip
                assert all(self.ledger.mark_generated(group))
                for t in group:
                    sender.send(t)


def flat_every_third(i: int) -> list[float]:
    return [1.0] * GROUP_SIZE if i % 3 == 1 else [0.0, 1.0, 0.0, 1.0]


def only_the_first(i: int) -> list[float]:
    return [0.0, 1.0, 1.0, 0.0] if i == 0 else [0.5] * GROUP_SIZE


def run_steps(redis_url: str, run: str, mode: str, rewards=flat_every_third, steps=STEPS, skip_last=False, more=()):
    """`steps` steps through `Admission` (the trainer's version moves by one at each step that updates; a
    step with nothing to train takes none); what each step trained, and the books at the end (the node
    gone, the run settled)."""
    shape = [f"run.steps={steps}", f"learner.groups_per_step={PER_STEP}", f"rollout.group_size={GROUP_SIZE}"]
    rules = [f"run.mode='{mode}'", "loss.dynamic_sampling=true", "ledger.max_staleness=1"]
    cfg = build({}, [*shape, *rules, *more, f"run.name='{run}'"])
    ledger = Ledger(connect(redis_url), run, cfg.ledger)
    claim_run(ledger, cfg, resumed_version=None, first_step=1)
    receiver = TrajectoryReceiver()
    intake = Intake(receiver, ledger, StallAlarm(60.0, 0.0, ledger.counts), order_patience_s=5.0)
    version = [0]  # stands in for the trainer's version (learner/train_step.py owns it in a run)
    admission = Admission(cfg, ledger, intake, lambda: version[0], serve=lambda: None, node_count=lambda: 1)
    node = FakeNode(ledger, receiver.addr, rewards)
    node.start()
    out = {"trained": [], "batches": [], "selections": []}
    try:
        deadline = time.monotonic() + 10  # the node fills what the ledger lets it take before step 1
        while node.admitted < (PER_STEP if mode == "sync" else 2 * PER_STEP) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # and would run further ahead if the ledger let it
        for step in range(1, steps + 1):
            started = version[0]
            out["batches"].append(admission.next_batch(ranks=2, step=step))
            skipped = not admission.selection.train or skip_last and step == steps
            out["trained"].append((started, [t.policy_version for t in admission.selection.train]))
            if not skipped:
                version[0] += 1  # the trainer took the update
            admission.commit(step, {"skipped": float(skipped)})
            out["selections"].append(admission.hand_over())
    finally:
        node.stop.set()
        node.join(10)
        out["leftover"] = ledger.leave("n") + intake.drop_held("preempted") + ledger.drop_received("preempted")
        admission.settle_books(finished=True)
        intake.close()
    out["counts"], out["counters"], out["version"] = ledger.counts(), intake.counters, ledger.current_version()
    assert ledger.check(deep=True) == []
    return out


@pytest.fixture
def async_run(redis_url, ledger_run):
    return run_steps(redis_url, ledger_run, "async", skip_last=True)


def test_dynamic_sampling_trains_every_steps_groups_and_drops_the_flat_ones_in_the_books(async_run):
    for selection in async_run["selections"]:
        assert len(selection.groups) == PER_STEP and not selection.unfilled
        assert all(len({t.reward for t in group}) > 1 for group in selection.groups)
    flat_groups = sum(s.zero_variance for s in async_run["selections"])
    assert flat_groups >= 1  # g1 is flat and comes into step 1
    # the drops are in the ledger and in the intake's counters (the report's samples_zero_variance)
    counts = async_run["counts"]
    assert counts.dropped_by_reason["zero_variance"] == flat_groups * GROUP_SIZE
    assert async_run["counters"]["zero_variance"] == flat_groups * GROUP_SIZE
    rates = [s.metrics(PER_STEP)["filter/zero_variance_rate"] for s in async_run["selections"]]
    assert sum(s.examined for s in async_run["selections"]) == STEPS * PER_STEP + flat_groups and max(rates) > 0


def test_the_books_balance_to_the_sample_and_admission_never_ran_past_the_steps_left(async_run):
    counts = async_run["counts"]
    assert counts.total == counts.trained + counts.dropped and counts.in_flight == 0
    flat = counts.dropped_by_reason["zero_variance"]
    assert counts.dropped == flat + counts.dropped_by_reason["no_gradient"] + async_run["leftover"]
    # every group admitted was trained, dropped as flat or skipped, or (async) one step's worth left over
    assert counts.total <= STEPS * PER_STEP * GROUP_SIZE + flat + PER_STEP * GROUP_SIZE


def test_each_rank_gets_its_share_of_the_steps_samples_at_the_steps_version(async_run):
    for (started, trained), batches in zip(async_run["trained"], async_run["batches"]):
        assert len(batches) == 2 and {b.version for b in batches} == {started}
        ids = [sid for b in batches for mb in b.micro_batches for sid in mb.sample_ids]
        assert len(ids) == len(set(ids)) == PER_STEP * GROUP_SIZE == len(trained)
        assert all(b.loss_tokens == PER_STEP * GROUP_SIZE * 2 for b in batches)  # 2 completion tokens each


def test_a_skipped_step_drops_its_samples_and_the_version_stays(async_run):
    # steps 1 and 2 trained (version 2); step 3 took no update: its 2 groups are no_gradient, not trained
    counts = async_run["counts"]
    assert async_run["version"] == 2
    assert counts.trained == 2 * PER_STEP * GROUP_SIZE
    assert counts.dropped_by_reason["no_gradient"] == PER_STEP * GROUP_SIZE
    assert async_run["counters"]["no_gradient"] == PER_STEP * GROUP_SIZE
    assert counts.in_flight == 0 and counts.total == counts.trained + counts.dropped


def test_async_runs_a_step_ahead(async_run):
    # the positive control of the sync test below: with capacity (1 + 1) x 2 groups, the node took
    # groups at version 0 that step 2 (starting at version 1) trains
    assert any(v < started for started, trained in async_run["trained"] for v in trained)


def test_sync_trains_every_step_on_the_learners_current_version(redis_url, ledger_run):
    run = run_steps(redis_url, ledger_run, "sync")
    for started, trained in run["trained"]:  # replacements for flat groups too: the version had not moved
        assert trained and set(trained) == {started}
    assert run["version"] == STEPS and run["counts"].trained == STEPS * PER_STEP * GROUP_SIZE
    assert sum(s.zero_variance for s in run["selections"]) >= 1  # and a flat group was replaced


def test_a_step_that_cannot_fill_within_the_bound_trains_what_it_has(redis_url, ledger_run):
    # only group g0 has variance; refill_limit 1: each step examines at most 2 + 2 groups
    run = run_steps(redis_url, ledger_run, "async", only_the_first, steps=2, more=["loss.refill_limit=1"])
    first, second = run["selections"]
    assert [g[0].group_id for g in first.groups] == ["g0"] and first.unfilled and first.examined == 4
    assert second.groups == [] and second.train == [] and second.examined == 4 and second.zero_variance == 4
    assert run["version"] == 1  # the second step had nothing to train: no update, the version stays
    counts = run["counts"]
    assert counts.trained == GROUP_SIZE and counts.dropped_by_reason["zero_variance"] == 7 * GROUP_SIZE
