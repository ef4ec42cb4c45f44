"""Nodes that fetch their weights from the learner's one shared set (learner/shared_fetch.py), in real
processes: 12 simulated nodes (bench/scale_out.py's), two processes of 6, all on shared memory, 10 of them
members of the one fetch (`weights.fetch_after = 2`). One process is killed (`kill -9`) mid-run: the 6
others keep taking new versions live without waiting for a dead member's deadline (`weights.timeout_s =
30`), the learner trains on, and at the stop the books balance."""

from __future__ import annotations

import argparse
import signal
import time

import pytest

from streamrl.bench import scale_out
from streamrl.bench._scale_out_nodes import ended, start_workers
from streamrl.engine.config import build
from streamrl.ops.launcher import Launcher

pytestmark = pytest.mark.slow

NODES, PER_PROCESS, TIMEOUT_S = 12, 6, 30.0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    args = argparse.Namespace(group_s=1.0, group_size=2, tokens=64, train_s=0.5,
                              sets=["weights.fetch_after=2", f"weights.timeout_s={TIMEOUT_S}"])  # fmt: skip
    launcher = Launcher(build({}, scale_out.run_sets(NODES, args, str(tmp_path_factory.mktemp("fetch")))))
    workers = []
    try:
        launcher.start(0)
        workers = start_workers(launcher, NODES, PER_PROCESS)
        first = scale_out.wait_registered(launcher.run_dir, NODES, launcher.learner, 300) + 1
        scale_out.wait_for_step(launcher.run_dir, first + 2, launcher.learner, 300)
        workers[1].send_signal(signal.SIGKILL)  # nodes 6..11, whatever their round is doing
        killed_at = time.time()
        records = scale_out.wait_for_step(launcher.run_dir, first + 10, launcher.learner, 300)
        stopped_at = time.time()
        launcher.learner.process.send_signal(signal.SIGTERM)
        launcher.learner.process.wait(timeout=120)
        ended(workers[0], deadline=time.monotonic() + 120)
        return {"events": scale_out.read_events(launcher.run_dir), "killed_at": killed_at, "stopped_at": stopped_at,
                "records": records, "books": scale_out.books(launcher), "log": launcher.learner.log_tail()}  # fmt: skip
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        launcher.stop_all()


def _live(events: list[dict], node: str) -> list[tuple[int, float]]:
    return [(e["version"], e["t"]) for e in events if e["event"] == "live" and e["role"] == node]


def test_every_node_took_weights_before_the_kill(run):
    for i in range(NODES):
        assert any(t < run["killed_at"] for _, t in _live(run["events"], f"node-{i}")), i


def test_the_killed_nodes_took_nothing_after_the_kill_and_the_survivors_did(run):
    # the killed nodes stay members until the ledger reaps them (ledger.heartbeat_ttl_s) or their round's
    # deadline evicts them: the survivors' versions below came while dead members were still in the rounds
    after = {i: [v for v, t in _live(run["events"], f"node-{i}") if t > run["killed_at"] + 1.0] for i in range(NODES)}
    assert not any(after[i] for i in range(6, 12)), after
    assert all(after[i] for i in range(6)), after  # the positive control


def test_the_survivors_take_each_new_version_without_a_dead_members_deadline(run):
    # a node behind skips to the newest version, so a survivor may miss one; each takes most, and all 6 have a
    # version published after the kill live within a few seconds of it (a round that waited for a dead
    # member's copy would hold them for weights.timeout_s = 30 s)
    events, killed_at = run["events"], run["killed_at"]
    published = sorted(e["version"] for e in events if e["event"] == "step" and e["t"] > killed_at)
    assert len(published) >= 6, published
    for i in range(6):
        live = dict(_live(events, f"node-{i}"))
        assert len(set(published) & set(live)) >= len(published) // 2, (i, published, sorted(live))
        assert max(live) >= published[-2], (i, published, sorted(live))
    first_all = max(min(t for v, t in _live(events, f"node-{i}") if v >= published[0]) for i in range(6))
    assert first_all - killed_at < TIMEOUT_S / 3, first_all - killed_at


def test_books_balance(run):
    assert run["books"].startswith("books balance:"), run["books"] + run["log"]
