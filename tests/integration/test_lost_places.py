"""A group given up with its node leaves its place empty (learner/places.py), through the learner's real
`Admission` and `Intake` over real Redis and ZMQ: the step it was admitted for trains the groups it has, at
once, instead of taking in the next step's group (made from scratch after a kill, it held the step up to 2.4
step times at the defaults); its credit stays held until that step ends, so the group admitted in its stead
goes after the step, and the next step does not wait for it either. The books balance to the sample."""

from __future__ import annotations

import threading
import time

from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import Trajectory
from streamrl.engine.redis_server import connect
from streamrl.engine.transport import TrajectoryReceiver, TrajectorySender
from streamrl.learner.admission import Admission, claim_run
from streamrl.learner.intake import Intake, StallAlarm
from streamrl.learner.overdue import GONE_S, OverdueGroups
from streamrl.learner.places import LostPlaces

GROUP_SIZE, PER_STEP = 2, 2
LATE_S = 3.0  # the next step's group comes this long after the step started to wait (it was barely begun)


def _group(group_id: str, rewards=(0.0, 1.0), node: str = "live") -> list[Trajectory]:
    return [
        Trajectory(sample_id=f"{group_id}:{i}", group_id=group_id, node_id=node, seq=0, prompt_ids=[3, 4],
                   completion_ids=[10, 11], behavior_logprobs=[-1.0, -1.0], reward=r, policy_version=0,
                   group_size=GROUP_SIZE, finish_reason="stop")
        for i, r in enumerate(rewards)
    ]  # fmt: skip


def _send(ledger: Ledger, sender: TrajectorySender, group_id: str, node: str = "live", rewards=(0.0, 1.0)) -> None:
    group = _group(group_id, rewards, node)
    assert all(ledger.mark_generated(group))
    for trajectory in group:
        sender.send(trajectory)


def _claimed(redis_url: str, run: str, per_step: int = PER_STEP, *settings: str):
    """(config, ledger) of a run the learner claimed, `per_step` groups a step, at most one version stale."""
    cfg = build({}, [f"run.name='{run}'", f"learner.groups_per_step={per_step}", f"rollout.group_size={GROUP_SIZE}",
                     "ledger.max_staleness=1", "run.steps=100", *settings])  # fmt: skip
    ledger = Ledger(connect(redis_url), run, cfg.ledger)
    claim_run(ledger, cfg, resumed_version=None, first_step=1)
    return cfg, ledger


def _admit(ledger: Ledger, groups) -> None:
    """Each (node, group) admitted, in this order, its node beating."""
    for node, group in groups:
        ledger.heartbeat(node)
        assert ledger.take_credit(node, group, GROUP_SIZE, node_version=0)


def _intake(ledger: Ledger, gone: dict[str, float], per_step: int = PER_STEP) -> Intake:
    """The learner's intake, its nodes' closed connections read from `gone` (Reachability.unreachable_s)."""
    overdue = OverdueGroups(ledger, silent_s=lambda node: 0.1, window=8, unreachable_s=lambda: dict(gone))
    return Intake(TrajectoryReceiver(), ledger, StallAlarm(60.0, 0.0, ledger.counts), order_patience_s=30.0,
                  overdue=overdue, places=LostPlaces(per_step))  # fmt: skip


def test_a_step_goes_without_the_group_its_killed_node_held_and_the_credit_waits_for_the_steps_end(
    redis_url, ledger_run
):
    cfg, ledger = _claimed(redis_url, ledger_run)
    # admitted in this order: step 1 is [a, d] (d on the node about to die), step 2 [b, c]; the capacity is full
    _admit(ledger, (("live", "a"), ("dead", "d"), ("live", "b"), ("live", "c")))
    assert ledger.take_credit("live", "r0", GROUP_SIZE, node_version=0) is None  # positive control: full
    intake = _intake(ledger, {"dead": GONE_S})  # its control connection found closed
    admission = Admission(cfg, ledger, intake, lambda: 0, serve=lambda: None, node_count=lambda: 1)
    with TrajectorySender(intake.addr, "live", send_timeout_s=10) as sender:
        try:
            _send(ledger, sender, "a")
            late = threading.Timer(LATE_S, _send, (ledger, sender, "b"))  # step 2's first group, barely begun
            late.start()
            started = time.monotonic()
            admission.next_batch(ranks=1, step=1)
            took = time.monotonic() - started
            step1 = [g[0].group_id for g in admission.selection.groups]
            # the lost group's place stays empty: no new group is admitted into step 1 (the capacity counts it)
            assert ledger.take_credit("live", "r1", GROUP_SIZE, node_version=0) is None
            admission.commit(1, {"skipped": 0.0})  # the step's end: the place goes with it
            replacement = ledger.take_credit("live", "r2", GROUP_SIZE, node_version=0)
            late.join()
            _send(ledger, sender, "c")
            started = time.monotonic()
            admission.next_batch(ranks=1, step=2)  # b and c; r2 (never sent) is step 3's
            took_next = time.monotonic() - started
            step2 = [g[0].group_id for g in admission.selection.groups]
            admission.commit(2, {"skipped": 0.0})
        finally:
            intake.close()
    # step 1 trained a alone as soon as d was given up; before, it took b in d's place, 3 s later
    assert step1 == ["a"] and took < 1.0, (step1, took)
    assert replacement is not None and step2 == ["b", "c"] and took_next < 1.0, (step2, took_next)
    assert ledger.counts().dropped_by_reason == {"overdue": GROUP_SIZE}
    assert ledger.oldest_open_groups(5) == ["r2"]
    ledger.drop([f"r2:{i}" for i in range(GROUP_SIZE)], "preempted")
    assert ledger.check(deep=True) == []


def test_a_group_the_step_took_is_not_given_up_when_its_node_dies_during_a_refill(redis_url, ledger_run):
    """Dynamic sampling's refill: the step holds the groups it took (open in the ledger until it commits); their
    node killed meanwhile must not make the learner give them up (once it did: their received samples dropped as
    `overdue`, then trained, and their place counted lost)."""
    _, ledger = _claimed(redis_url, ledger_run)
    _admit(ledger, (("dead", "d"), ("live", "a"), ("live", "b")))
    gone: dict[str, float] = {}
    intake = _intake(ledger, gone)
    with TrajectorySender(intake.addr, "live", send_timeout_s=10) as sender:
        try:
            _send(ledger, sender, "d", node="dead")  # sent before its node died
            took = intake.collect(1, 0, between=lambda: None, waiting_hint=lambda: "")
            assert [g[0].group_id for g in took] == ["d"]
            gone["dead"] = GONE_S  # its node is killed: its connection found closed
            late = threading.Timer(0.5, _send, (ledger, sender, "a"))  # the refill waits for a meanwhile
            late.start()
            refill = intake.collect(1, 0, between=lambda: None, waiting_hint=lambda: "", holding={"d"}, refill=True)
            late.join()
        finally:
            intake.close()
    assert [g[0].group_id for g in refill] == ["a"]
    assert ledger.counts().dropped_by_reason == {} and intake.places.short == 0  # d is trained, not given up
    assert ledger.oldest_open_groups(5) == ["d", "a", "b"]


def test_a_refill_after_every_group_was_dropped_counts_the_lost_place_once(redis_url, ledger_run):
    """Dynamic sampling drops every group of the step's first take (zero variance): its refill asks for what the
    step still lacks, the lost place already taken off. Once the intake took the place off a second time (a
    refill holding nothing looked like a first take): one group fewer a take, refill budget spent for nothing."""
    per_step = 3
    cfg, ledger = _claimed(redis_url, ledger_run, per_step, "loss.dynamic_sampling=true")
    _admit(ledger, (("dead", "d"), ("live", "z1"), ("live", "z2"), ("live", "g1"), ("live", "g2")))
    intake = _intake(ledger, {"dead": GONE_S}, per_step)
    admission = Admission(cfg, ledger, intake, lambda: 0, serve=lambda: None, node_count=lambda: 1)
    with TrajectorySender(intake.addr, "live", send_timeout_s=10) as sender:
        try:
            for group in ("z1", "z2"):
                _send(ledger, sender, group, rewards=(1.0, 1.0))
            late = threading.Timer(0.5, lambda: [_send(ledger, sender, g) for g in ("g1", "g2")])
            late.start()
            admission.next_batch(ranks=1, step=1)
            late.join()
            selection = admission.selection
        finally:
            intake.close()
    assert [g[0].group_id for g in selection.groups] == ["g1", "g2"]  # d's place empty, z1 and z2 dropped
    assert selection.refilled == 2, selection.refilled  # the two groups it lacked (the old intake: 1, then 1 more)
