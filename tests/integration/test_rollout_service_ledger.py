"""The registered node's ledger seams: credits admit the group's samples; a sample the ledger no
longer gives this node is not sent."""

import asyncio

from streamrl.engine.ledger import Ledger, sample_ids
from streamrl.engine.messages import Trajectory
from streamrl.engine.redis_server import connect
from streamrl.rollout.service import LedgerCredits, LedgerSink


class FakeSender:
    """Stands in for the node's `TrajectorySender` (the ZMQ socket to the learner): keeps the ids sent."""

    def __init__(self):
        self.sent = []

    def send(self, traj):
        self.sent.append(traj.sample_id)
        return len(self.sent) - 1


def _traj(sample_id: str, group_id: str) -> Trajectory:
    return Trajectory(
        sample_id=sample_id,
        group_id=group_id,
        node_id="n0",
        seq=0,
        prompt_ids=[1],
        completion_ids=[2],
        behavior_logprobs=[-0.5],
        reward=1.0,
        policy_version=0,
    )


def test_credits_admit_and_a_sample_no_longer_ours_is_not_sent(redis_url, ledger_run):
    ledger = Ledger(connect(redis_url), ledger_run)
    ledger.init_run(groups_per_step=1)
    ledger.heartbeat("n0")
    credits, sender = LedgerCredits(ledger, "n0"), FakeSender()
    ids = sample_ids("n0-abc123-g0", 2)
    assert asyncio.run(credits.acquire("n0-abc123-g0", ids))
    sink = LedgerSink(ledger, sender)
    assert sink.send(_traj(ids[0], "n0-abc123-g0")) == 0
    ledger.drop([ids[1]], "node_lost")  # e.g. reaped while this node was slow
    assert sink.send(_traj(ids[1], "n0-abc123-g0")) == -1
    assert sender.sent == [ids[0]]
    ledger.drop([ids[0]], "preempted")  # close the books for the fixture's balance check


def test_credits_beat_again_when_a_restarted_redis_forgot_the_heartbeat(redis_url, ledger_run):
    """A Redis back from its append-only file has no heartbeat that expired while it was down: the
    node's next admission beats again instead of failing (it stopped the node before)."""
    ledger = Ledger(connect(redis_url), ledger_run)
    ledger.init_run(groups_per_step=1)
    ledger.heartbeat("n0")
    ledger.client.delete(ledger.prefix + "alive:n0")  # what the restart leaves
    assert ledger.alive_nodes() == []
    ids = sample_ids("n0-abc123-g1", 2)
    assert asyncio.run(LedgerCredits(ledger, "n0").acquire("n0-abc123-g1", ids))
    assert ledger.alive_nodes() == ["n0"]
    ledger.drop(ids, "preempted")
