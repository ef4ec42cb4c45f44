"""`OverdueGroups` over a real ledger: a group held by a silent node is given up (its samples dropped
as `overdue`, its credit back) once the learner waited for it longer than the slowest group measured
lately, and at once (without that deadline) when its node's connection closed; a group of a node still beating is
never given up, however long it takes."""

from __future__ import annotations

import math

from streamrl.engine.ledger import Ledger, sample_ids
from streamrl.engine.messages import Timings, Trajectory
from streamrl.engine.redis_server import connect
from streamrl.learner.overdue import GONE_S, MARGIN_S, SILENT_S, OverdueGroups


def _took(seconds: float) -> Trajectory:
    return Trajectory(sample_id="x:0", group_id="x", node_id="n", seq=0, prompt_ids=[1], completion_ids=[2],
                      behavior_logprobs=[-0.5], reward=1.0, policy_version=0,
                      timings=Timings(submitted=100.0, finished=100.0 + seconds, rewarded=100.0 + seconds))  # fmt: skip


def test_a_silent_nodes_group_is_given_up_after_the_slowest_group_time_and_a_beating_nodes_never(redis_url, ledger_run):
    ledger = Ledger(connect(redis_url), ledger_run)
    ledger.init_run(groups_per_step=2)
    silence = {"frozen": SILENT_S + 1.0, "slow": 0.4}  # seconds since each node was last heard
    for node in silence:
        ledger.heartbeat(node)
        assert ledger.take_credit(node, f"g-{node}", 2)
    overdue = OverdueGroups(ledger, lambda node: silence.get(node, math.inf), window=8)
    waited = ["g-frozen", "g-slow"]
    assert overdue.give_up(waited, now=0.0) == {} and overdue.deadline_s is None  # nothing measured: wait on
    overdue.measure([_took(1.0), _took(3.0), _took(2.0)])
    assert overdue.deadline_s == 3.0 + MARGIN_S  # the slowest of the window
    assert overdue.give_up(waited, now=3.0) == {}  # waited 3.0 s < 3.5 s
    assert overdue.give_up(waited, now=3.6) == {"g-frozen": 2}  # past it; g-slow's node still beats
    assert ledger.oldest_open_groups(5) == ["g-slow"] and ledger.groups_in_flight() == 1  # the credit is back
    assert ledger.counts().dropped_by_reason == {"overdue": 2}
    assert overdue.give_up(["g-slow"], now=1000.0) == {}  # slow, but alive: never given up
    silence["slow"] = SILENT_S  # now silent too
    assert overdue.give_up(["g-slow"], now=1000.1) == {"g-slow": 2}
    assert ledger.groups_in_flight() == 0 and overdue.given_up == 2
    assert ledger.drop(sample_ids("g-slow", 2), "overdue") == [False, False]  # resolved once, for good


def test_a_node_whose_connection_closed_has_its_groups_given_up_before_the_deadline(redis_url, ledger_run):
    """Its process is gone (`Reachability.unreachable_s`): no deadline, no 2 s of silence; only `GONE_S` for the
    frames it sent before it died. A silent node whose connection is open waits for both, as above."""
    ledger = Ledger(connect(redis_url), ledger_run)
    ledger.init_run(groups_per_step=2)
    for node in ("killed", "frozen"):
        ledger.heartbeat(node)
        assert ledger.take_credit(node, f"g-{node}", 2)
    closed = {"killed": 0.0}  # seconds since its connection was found closed
    overdue = OverdueGroups(ledger, lambda node: 0.5, window=8, unreachable_s=lambda: dict(closed))
    waited = ["g-killed", "g-frozen"]
    assert overdue.give_up(waited, now=0.0) == {}  # nothing measured, and the closed connection too fresh
    closed["killed"] = GONE_S
    assert overdue.give_up(waited, now=0.1) == {"g-killed": 2}  # no deadline measured yet: not needed
    overdue.measure([_took(3.0)])
    assert overdue.give_up(["g-frozen"], now=100.0) == {}  # past its deadline, but its node was heard 0.5 s ago
    assert ledger.oldest_open_groups(5) == ["g-frozen"] and ledger.counts().dropped_by_reason == {"overdue": 2}
