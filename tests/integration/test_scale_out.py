"""64 simulated rollout nodes against one learner (bench/scale_out.py's run, small): every node registers,
the learner trains samples of every node, every node takes the learner's weights, nothing is dropped
before the stop, and the books balance.

One process of 64 nodes; every node is the product's `serve` with its own id, sockets, credits
and weight receiver, generating with the sleeping engine (rollout/backends/sim.py) and taking the
versions the learner pushes (shared memory)."""

from __future__ import annotations

import argparse

import pytest

from streamrl.bench import scale_out

pytestmark = pytest.mark.slow

NODES = 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # 32 groups a step (NODES / 2) of 2 samples, 64 tokens each; a node takes 1 s a group, so the 64 nodes
    # offer 64 groups/s; 4 steps of 0.5 s are measured once all 64 registered, then the learner is stopped
    args = argparse.Namespace(steps=4, group_s=1.0, group_size=2, tokens=64, per_worker=NODES, train_s=0.5,
                              timeout_s=300.0, sets=[])  # fmt: skip
    return scale_out.measure(NODES, args, str(tmp_path_factory.mktemp("scale")))


def test_every_node_registered(run):
    assert run["line"]["registered"] == NODES


def test_every_node_trained_samples(run):
    trained = run["trained_by_node"]
    assert sorted(trained) == sorted(f"node-{i}" for i in range(NODES))
    assert min(trained.values()) >= 2  # a whole group of 2 samples at least


def test_books_balance(run):
    # at least the 4 measured steps x 32 groups x 2 samples trained; what was in flight at the stop resolved
    line = run["line"]
    assert line["books"].startswith("books balance:"), line["books"]
    assert sum(run["trained_by_node"].values()) >= 4 * 32 * 2


def test_every_node_took_the_learners_weights(run):
    # a node behind skips to the newest version, so not every version reaches every node: each took one
    # live, and at least one version reached all 64 (steps of 0.5 s; the push to 64 nodes takes ~0.05 s)
    line = run["line"]
    assert line["nodes_live"] == NODES and line["push_versions"] >= 1, line
    assert line["workers_killed"] == 0 and not line["drops"], line  # nothing dropped before the stop
