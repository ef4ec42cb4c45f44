"""`kill -9` of the learner mid-run, a new one resumed from the last checkpoint, the nodes left running.

The resumed learner tells the truth: samples trained in the steps its checkpoint does not contain
are re-marked `dropped:rolled_back` (exactly those, counted in the first metrics record), the version
and the step numbers continue from the checkpoint. The nodes see the new incarnation in the ledger,
resolve what they generated for the dead learner and register with the new one: training continues
to the last step with no stale flood, and the books close with nothing lost or unresolved.

One node is stopped (SIGTERM) while no learner runs: its sends have no one to go to, and it still
exits within its bound (`stop_bound_s`), holding nothing.
"""

from __future__ import annotations

import threading
import time

import pytest

from streamrl.learner import checkpoint
from streamrl.rollout.service import stop_bound_s

pytestmark = [pytest.mark.faults, pytest.mark.vllm, pytest.mark.slow]

STEPS = 14
EVERY = 3


def _trained_by(ledger, first_version: int, last_version: int) -> set[str]:
    """Samples the ledger has as trained by policy versions first..last (what a roll-back to first undoes)."""
    out: set[str] = set()
    for v in range(first_version, last_version + 1):
        out |= ledger.client.smembers(f"{ledger.prefix}tv:{v}")
    return out


def test_learner_killed_and_resumed_with_its_nodes_left_running(fault_run, fault_tools):
    # the nodes' sends wait for a learner this long: room for a new learner to start on a loaded machine
    run = fault_run([f"run.steps={STEPS}", f"checkpoint.every={EVERY}", "transport.send_timeout_s=180"])
    launcher, root = run.launcher, checkpoint.checkpoints_dir(run.run_dir)
    launcher.start(nodes=2)

    def past_a_checkpoint():
        saved = checkpoint.list_checkpoints(root)
        return saved and run.records() and run.records()[-1]["step"] >= saved[-1][0] + 2

    run.wait(past_a_checkpoint, "two steps past a checkpoint", 600)
    killed = time.time()
    fault_tools.kill(launcher.learner.process.pid)
    launcher.learner.process.wait(timeout=30)
    ledger = run.ledger
    dead_version = ledger.current_version()
    resumed_step = checkpoint.list_checkpoints(root)[-1][0]
    resumed_version = int(next(r["version"] for r in run.records() if r["step"] == resumed_step))
    trained_after = _trained_by(ledger, resumed_version, dead_version)
    at_kill = ledger.counts()
    stale_before = at_kill.dropped_by_reason.get("stale", 0)
    assert trained_after, "the kill came before any step past the checkpoint committed"

    stopped: dict = {}

    def stop_a_node():
        start = time.monotonic()
        stopped["code"] = launcher.stop_node("node-1")
        stopped["seconds"] = time.monotonic() - start

    stopper = threading.Thread(target=stop_a_node)
    stopper.start()
    launcher.restart_learner("latest")  # node-0 is left running
    stopper.join(timeout=stop_bound_s(run.cfg) + 30)
    assert launcher.learner.process.wait(timeout=600) == 0, launcher.learner.log_tail(40)
    for child in launcher.nodes.values():
        assert child.process.wait(timeout=120) == 0, child.log_tail(30)

    records = run.records()
    new = [r for r in records if r["time"] > killed]
    stall = new[0]["time"] - killed
    rollback = ledger.rollbacks()[-1]
    states = {sid: ledger.record(sid).get("state") for sid in trained_after}
    counts = ledger.counts()
    stale = counts.dropped_by_reason.get("stale", 0) - stale_before
    trained_new = sum(r["samples"] for r in new)
    followed = [n for n in launcher.nodes if "the learner restarted" in launcher.nodes[n].log_path.read_text()]
    books = run.books_at_end()
    fault_tools.figure(
        "learner_kill9_resume",
        resumed_from_step=resumed_step,
        versions_rolled_back=dead_version - resumed_version,
        samples_rolled_back=len(trained_after),
        stall_s=round(stall, 1),
        stale_after_restart=stale,
        stale_per_trained_before=round(stale_before / max(at_kill.trained, 1), 2),
        stale_per_trained_after=round(stale / trained_new, 2),
        nodes_followed=len(followed),
        node_stopped_without_learner_s=round(stopped["seconds"], 1),
        **books,
    )
    # exactly the samples trained after the checkpoint were rolled back, and counted
    assert rollback["from"] == resumed_version and rollback["to"] == dead_version, rollback
    assert set(states.values()) == {"dropped:rolled_back"}, states
    assert new[0]["resume/rolled_back_samples"] == rollback["samples"] >= len(trained_after)
    # steps and versions continue from the checkpoint
    assert [r["step"] for r in new] == list(range(resumed_step + 1, STEPS + 1)), [r["step"] for r in new]
    assert [int(r["version"]) for r in new] == list(range(resumed_version + 1, resumed_version + 1 + len(new)))
    # the node stopped while no learner ran: within its bound, holding nothing
    assert stopped["code"] == 0 and stopped["seconds"] < stop_bound_s(run.cfg), stopped
    assert run.held_by("node-1") == 0
    # the node left running followed the new learner, with its weights: no stale flood (the nodes left running
    # by a dead learner once had 9,246 samples dropped stale while 11 steps trained); the share of
    # stale samples is the run's own, as before the kill
    assert followed == ["node-0"], followed
    assert stale / trained_new < stale_before / max(at_kill.trained, 1) + 0.25, (stale, trained_new, at_kill)
