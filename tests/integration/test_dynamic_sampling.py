"""Dynamic sampling through the ledger (real Redis, real ZMQ; the node and the orchestrator's loop are fakes):
zero-variance groups are dropped as `zero_variance`, their credits return, a node admits groups in their
place, and every step trains `groups_per_step` groups; the books balance to the sample, in async and in
sync mode, and a step that cannot fill within the refill bound trains what it has."""

from __future__ import annotations

import threading
import time

import pytest

from streamrl.engine.config import LedgerConfig, LossConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import Trajectory
from streamrl.engine.redis_server import connect
from streamrl.engine.transport import TrajectoryReceiver, TrajectorySender
from streamrl.learner.intake import Intake, StallAlarm
from streamrl.learner.selection import select

GROUP_SIZE, PER_STEP, STEPS = 4, 2, 4


class FakeNode(threading.Thread):
    """Stands in for a rollout node (rollout/node.py) without an engine: takes a credit with the ledger's
    current version (a node holding the newest weights), marks the group generated and sends it over real
    ZMQ. Group i's rewards: `rewards(i)`."""

    def __init__(self, ledger: Ledger, addr: str, rewards):
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
                               policy_version=version, group_size=GROUP_SIZE)
                    for sid, r in zip(ids, rewards)
                ]  # fmt: skip
                assert all(self.ledger.mark_generated(group))
                for t in group:
                    sender.send(t)


def fake_orchestrator(redis_url, run, mode, rewards, loss: LossConfig, steps=STEPS):
    """Stands in for the orchestrator's select -> commit / skip loop (learner/orchestrator.py), without a
    learner, to read the ledger's books to the sample; test_short_run.py drives the real one in a run."""
    ledger = Ledger(connect(redis_url), run, LedgerConfig(max_staleness=1, heartbeat_ttl_s=30))
    ledger.init_run(PER_STEP, mode, steps_left=steps)
    receiver = TrajectoryReceiver()
    intake = Intake(receiver, ledger, StallAlarm(60.0, 0.0, ledger.counts), order_patience_s=5.0)
    node = FakeNode(ledger, receiver.addr, rewards)
    node.start()
    selections = []
    try:
        for step in range(1, steps + 1):
            version = ledger.current_version()

            def take(n, holding, version=version):
                return intake.collect(n, version, lambda: None, lambda: "test node", holding=holding)

            selection = select(take, ledger.drop, PER_STEP, loss, limit=2)
            selections.append(selection)
            if selection.train:
                ledger.commit_step([t.sample_id for t in selection.train], version + 1, step, steps_left=steps - step)
            else:  # nothing to train: the learner takes no update, the version stays (learner/train_step.py)
                ledger.skip_step({"no_gradient": []}, steps_left=steps - step)
    finally:
        node.stop.set()
        node.join(10)
        leftover = intake.drop_held("preempted") + ledger.drop_received("preempted") + ledger.leave("n")
        intake.close()
    return ledger, selections, leftover


def flat_every_third(i: int) -> list[float]:
    return [1.0] * GROUP_SIZE if i % 3 == 1 else [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_dynamic_sampling_keeps_the_step_size_and_the_books_exact(redis_url, ledger_run, mode):
    ledger, selections, leftover = fake_orchestrator(
        redis_url, ledger_run, mode, flat_every_third, LossConfig(dynamic_sampling=True)
    )
    for s in selections:  # every step its groups: PER_STEP x GROUP_SIZE samples, none flat
        assert len(s.groups) == PER_STEP and len(s.train) == PER_STEP * GROUP_SIZE and not s.unfilled
        assert all(len({t.reward for t in g}) > 1 for g in s.groups)
    dropped_groups = sum(s.zero_variance for s in selections)
    assert dropped_groups >= 2  # groups g1, g4 came into the first steps, and were replaced
    counts = ledger.counts()
    assert counts.trained == STEPS * PER_STEP * GROUP_SIZE
    assert counts.dropped_by_reason.get("zero_variance", 0) == dropped_groups * GROUP_SIZE
    assert counts.total == counts.trained + counts.dropped and counts.in_flight == 0
    assert counts.dropped == dropped_groups * GROUP_SIZE + leftover
    assert ledger.check(deep=True) == []
    rates = [s.metrics(PER_STEP)["filter/zero_variance_rate"] for s in selections]
    assert sum(s.examined for s in selections) == STEPS * PER_STEP + dropped_groups and max(rates) > 0
    # admission never ran ahead of what the remaining steps train: every group admitted was trained,
    # dropped as zero_variance, or (async) one step's worth left in flight at the end
    assert counts.total <= (STEPS * PER_STEP + dropped_groups + PER_STEP) * GROUP_SIZE


def test_a_step_that_cannot_fill_within_the_bound_trains_what_it_has(redis_url, ledger_run):
    # only group g0 has variance; refill_limit 1: each step examines at most 2 + 2 groups
    ledger, selections, _ = fake_orchestrator(
        redis_url,
        ledger_run,
        "async",
        lambda i: [0.0, 1.0, 1.0, 0.0] if i == 0 else [0.5] * GROUP_SIZE,
        LossConfig(dynamic_sampling=True, refill_limit=1),
        steps=2,
    )
    first, second = selections
    assert [g[0].group_id for g in first.groups] == ["g0"] and first.unfilled and first.examined == 4
    assert second.groups == [] and second.train == [] and second.examined == 4 and second.zero_variance == 4
    counts = ledger.counts()
    assert counts.trained == GROUP_SIZE and counts.dropped_by_reason["zero_variance"] == 7 * GROUP_SIZE
    assert ledger.check(deep=True) == []
