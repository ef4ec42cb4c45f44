"""The ledger against a real Redis: legal moves only, trained at most once, credits, nodes, versions."""

import time

import pytest

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger, LedgerError
from streamrl.engine.messages import Trajectory
from streamrl.engine.redis_server import connect


def _ledger(url, run, **cfg) -> Ledger:
    ledger = Ledger(connect(url), run, LedgerConfig(**cfg))
    ledger.init_run(groups_per_step=2)
    return ledger


def _trajectory(sample_id, version=0, reward=1.0, token_versions=(), node="n0"):
    return Trajectory(
        sample_id=sample_id,
        group_id=sample_id.split(":")[0],
        node_id=node,
        seq=0,
        prompt_ids=[1],
        completion_ids=[5] * len(token_versions or [0]),
        behavior_logprobs=[-0.5] * len(token_versions or [0]),
        reward=reward,
        policy_version=version,
        token_versions=list(token_versions),
    )


def _state(ledger, sample_id):
    return ledger.record(sample_id)["state"]


def test_a_sample_walks_the_legal_path_once(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run)
    ledger.heartbeat("n0")
    (sid,) = ledger.take_credit("n0", "g0", 1)
    assert _state(ledger, sid) == "admitted"
    assert ledger.mark_received([sid]) == [False]  # admitted -> received skips generated
    assert ledger.mark_trained([sid]) == [False]
    assert ledger.mark_generated([_trajectory(sid, version=0)]) == [True]
    assert ledger.mark_generated([_trajectory(sid, version=0)]) == [False]  # generated twice
    assert ledger.transition([sid], "trained") == ["generated"]  # the refusal names the state
    assert ledger.mark_received([sid]) == [True]
    assert ledger.mark_trained([sid]) == [True]
    assert ledger.mark_trained([sid]) == [False]
    assert ledger.drop([sid], "stale") == [False]  # a trained sample stays trained
    record = ledger.record(sid)
    assert record["state"] == "trained" and record["node"] == "n0" and record["group"] == "g0"
    assert float(record["t_adm"]) <= float(record["t_gen"]) <= float(record["t_rcv"]) <= float(record["t_end"])
    with pytest.raises(LedgerError, match="BAD_TARGET unknown target state admitted"):
        ledger.transition([sid], "admitted")


def test_drops_from_every_in_flight_state_and_never_twice(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run)
    ledger.heartbeat("n0")
    a, g, r = ledger.take_credit("n0", "g0", 3)
    ledger.mark_generated([_trajectory(g), _trajectory(r)])
    ledger.mark_received([r])
    assert ledger.drop([a], "overlong") == [True]
    assert ledger.drop([g], "reward_error") == [True]
    assert ledger.drop([r, r, "nope:0"], "preempted") == [True, False, False]
    assert [_state(ledger, s) for s in (a, g, r)] == ["dropped:overlong", "dropped:reward_error", "dropped:preempted"]
    counts = ledger.counts()
    assert (counts.total, counts.dropped, counts.in_flight) == (3, 3, 0)
    assert counts.dropped_by_reason == {"overlong": 1, "preempted": 1, "reward_error": 1}


def test_duplicate_delivery_is_trained_once(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run)
    ledger.heartbeat("n0")
    ids = ledger.take_credit("n0", "g0", 2)
    batch = [_trajectory(s) for s in ids]
    ledger.mark_generated(batch)
    first = ledger.receive(batch + batch[:1], current_version=0)  # the same frame delivered twice
    assert [s.sample_id for s in first.fresh] == ids
    assert first.rejected == [(ids[0], "received")]
    again = ledger.receive(batch, current_version=0)  # a late re-delivery
    assert again.fresh == [] and [r[0] for r in again.rejected] == ids
    assert ledger.commit_step(ids + ids, version=1, step=1) == [True, True, False, False]
    assert ledger.counts().trained == 2 and ledger.current_version() == 1
    assert ledger.staleness_histogram() == {0: 2}  # trained by version 0, before 1 was published


def test_receive_drops_stale_samples_and_failed_rewards(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run, max_staleness=1)
    ledger.heartbeat("n0")
    ids = ledger.take_credit("n0", "g0", 4)
    # at version 3 with max_staleness 1: version 2 is fresh (lag 1), version 1 is stale (lag 2),
    # and a sample whose first token came from version 3 but one token from version 1 is stale too
    batch = [
        _trajectory(ids[0], version=2),
        _trajectory(ids[1], version=1),
        _trajectory(ids[2], version=3, token_versions=[1, 3]),
        _trajectory(ids[3], version=3, reward=None),
    ]
    ledger.mark_generated(batch)
    ledger.publish_version(3, step=3)
    got = ledger.receive(batch, current_version=3)
    assert [s.sample_id for s in got.fresh] == [ids[0]]
    assert got.stale == [ids[1], ids[2]] and got.reward_errors == [ids[3]] and got.rejected == []
    ledger.publish_version(4, step=4)
    assert ledger.drop_stale(got.fresh, current_version=4) == []  # buffered past a step: lag 2 > 1
    assert ledger.record(ids[0])["state"] == "dropped:stale"
    assert ledger.counts().dropped_by_reason == {"reward_error": 1, "stale": 3}


def test_credits_bound_groups_in_flight_and_return_when_a_group_is_resolved(redis_url, ledger_run):
    ledger = Ledger(connect(redis_url), ledger_run, LedgerConfig(max_staleness=1))
    assert ledger.init_run(groups_per_step=2) == 4  # (1 + 1) * 2
    ledger.heartbeat("n0")
    ledger.heartbeat("n1")
    groups = [ledger.take_credit(f"n{i % 2}", f"g{i}", 2) for i in range(5)]
    assert [g is not None for g in groups] == [True, True, True, True, False]
    assert ledger.take_credit("n0", "g0", 2) == groups[0]  # a retried call holds the same credit
    ledger.drop(groups[0][:1], "overlong")
    assert ledger.take_credit("n1", "g5", 2) is None  # half a group resolved returns nothing
    ledger.drop(groups[0][1:], "overlong")
    assert ledger.groups_in_flight() == 3
    assert ledger.take_credit("n1", "g5", 2) is not None
    for group in groups[1:4]:
        ledger.drop(group, "preempted")
    ledger.leave("n1")
    assert ledger.groups_in_flight() == 0


def test_credit_refused_for_a_silent_node_a_reused_group_or_an_unset_run(redis_url, ledger_run):
    ledger = Ledger(connect(redis_url), ledger_run)
    ledger.heartbeat("n0")
    with pytest.raises(LedgerError, match="RUN_NOT_SET_UP"):
        ledger.take_credit("n0", "g0", 2)
    ledger.init_run(groups_per_step=1)
    with pytest.raises(LedgerError, match="NODE_NOT_ALIVE node ghost"):
        ledger.take_credit("ghost", "g0", 2)
    ids = ledger.take_credit("n0", "g0", 1)
    ledger.heartbeat("n1")
    with pytest.raises(LedgerError, match="GROUP_EXISTS group id g0"):
        ledger.take_credit("n1", "g0", 1)
    with pytest.raises(ValueError, match="group_id = 'a:b'"):
        ledger.take_credit("n0", "a:b", 1)
    ledger.drop(ids, "preempted")


def test_a_node_that_stops_beating_has_its_samples_dropped(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run, heartbeat_ttl_s=0.3)
    for node in ("dead", "live"):
        ledger.heartbeat(node)
    a, g, r = ledger.take_credit("dead", "g0", 3)
    other = ledger.take_credit("live", "g1", 1)
    ledger.mark_generated([_trajectory(g, node="dead"), _trajectory(r, node="dead")])
    ledger.mark_received([r])
    assert ledger.reap_lost_nodes() == {}
    time.sleep(0.4)
    ledger.heartbeat("live")
    assert ledger.reap_lost_nodes() == {"dead": 2}  # admitted + generated; the received one stays
    assert ledger.alive_nodes() == ["live"]
    assert [_state(ledger, s) for s in (a, g, r)] == ["dropped:node_lost", "dropped:node_lost", "received"]
    assert ledger.groups_in_flight() == 2  # g0 holds its credit until its received sample is trained
    assert ledger.mark_trained([r]) == [True]
    assert ledger.groups_in_flight() == 1
    assert ledger.mark_received([g]) == [False]  # a late frame from the dead node
    assert ledger.reap_lost_nodes() == {}
    ledger.drop(other, "preempted")


def test_readmit_hands_a_lost_nodes_group_to_another_node(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run, heartbeat_ttl_s=0.3, on_node_lost="readmit")
    ledger.heartbeat("dead")
    a, g, r = ledger.take_credit("dead", "g0", 3, prompt="row-17")
    ledger.mark_generated([_trajectory(g, node="dead"), _trajectory(r, node="dead")])
    ledger.mark_received([r])
    time.sleep(0.4)
    ledger.heartbeat("heir")
    assert ledger.claim_orphan("heir") is None
    assert ledger.reap_lost_nodes() == {"dead": 2}
    orphan = ledger.claim_orphan("heir")
    assert (orphan.group_id, orphan.prompt, orphan.sample_ids) == ("g0", "row-17", [a, g])
    assert ledger.claim_orphan("heir") is None
    assert ledger.groups_in_flight() == 1  # the credit stayed with the group
    ledger.heartbeat("dead")  # back from a pause: its old samples are the heir's now
    assert ledger.transition([a], "generated", [(0, 0, "dead")]) == ["owned by node heir"]
    assert ledger.mark_generated([_trajectory(a, node="heir"), _trajectory(g, node="heir")]) == [True, True]
    assert ledger.record(g)["node"] == "heir"
    assert ledger.mark_received([a, g]) == [True, True]
    assert ledger.mark_trained([a, g, r]) == [True, True, True]
    assert ledger.groups_in_flight() == 0 and ledger.counts().trained == 3


def test_versions_move_forward_with_their_history(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run)
    ledger.publish_version(1, step=1)
    ledger.publish_version(2, step=2)
    ledger.publish_version(2, step=2)  # a resumed learner republishes: no-op
    assert ledger.current_version() == 2
    assert [(r.version, r.step) for r in ledger.version_history()] == [(0, 0), (1, 1), (2, 2)]
    with pytest.raises(LedgerError, match="VERSION_BACKWARDS version 1 is older than the current 2"):
        ledger.publish_version(1, step=1)


def test_runs_sharing_a_server_keep_separate_books(redis_url):
    one, two = _ledger(redis_url, "run-one"), _ledger(redis_url, "run-two")
    one.heartbeat("n0")
    ids = one.take_credit("n0", "g0", 2)
    assert two.counts().total == 0 and two.record(ids[0]) == {}
    assert two.mark_received(ids) == [False, False]
    one.drop(ids, "preempted")


def test_a_client_without_decoded_responses_is_refused(redis_url):
    import redis

    with pytest.raises(ValueError, match="decode_responses=True"):
        Ledger(redis.Redis.from_url(redis_url), "x")
