"""The ledger's Redis killed with `kill -9` mid-run, twice (and the reaper across a restart).

1. Back within `ledger.retry_s` (restarted on its port from its append-only file): the learner and
   the nodes (hf: the ledger is what is tested) wait for it and carry on; the stall is the outage plus a step.
2. Gone for longer: the learner stops with exit 4 and an error naming the server, the nodes exit with
   an error too, and the ledger is intact: once Redis is back, every record agrees with the counters.
3. Gone for good under `streamrl run` (a vLLM node): one line saying so, exit 4, no traceback, no process
   of the run left (checked by pid: learner, node, its engine core, Redis).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import time

import pytest

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import RedisServer, connect

pytestmark = [pytest.mark.faults]

RETRY_S = 12.0
OUTAGE_S = 4.0


def test_a_restarted_redis_pauses_the_reaper_for_one_ttl(tmp_path, fault_tools):
    """Heartbeats that expired while the server was down are no news of the nodes: none is reaped
    until it had one TTL to beat again; a node that does not beat then is."""
    ttl = 1.0
    with RedisServer(tmp_path / "redis") as server:
        ledger = Ledger(connect(server.url), "r", LedgerConfig(heartbeat_ttl_s=ttl, retry_s=10.0))
        ledger.init_run(groups_per_step=1)
        for node in ("beats", "silent"):
            ledger.heartbeat(node)
            ledger.take_credit(node, f"g-{node}", 2)
        assert ledger.reap_lost_nodes() == {}  # the reaper meets this server
        fault_tools.kill(server.pid)
        server.process.wait(timeout=10)
        # a reap called during the outage retries through it (its `now` is from before the restart)
        reaping = concurrent.futures.ThreadPoolExecutor(1).submit(ledger.reap_lost_nodes)
        time.sleep(ttl + 0.5)  # both heartbeats expire while the server is down
        server.start()
        paused = reaping.result(timeout=10)  # a restart seen: nobody is judged on the outage
        assert ledger.alive_nodes() == []
        ledger.heartbeat("beats")
        time.sleep(ttl / 2)
        still_paused = ledger.reap_lost_nodes()
        ledger.heartbeat("beats")
        time.sleep(ttl / 2 + 0.1)
        after = ledger.reap_lost_nodes()
        fault_tools.figure("reaper_after_redis_restart", paused=paused, still_paused=still_paused, after=after)
        assert paused == {} and still_paused == {}
        assert after == {"silent": 2}
        ledger.drop(["g-beats:0", "g-beats:1"], "preempted")


@pytest.mark.slow
def test_redis_killed_mid_run_back_within_the_bound_then_gone_for_good(fault_run, fault_tools):
    run = fault_run(["run.steps=100000", "rollout.backend='hf'",  # a vLLM node under `streamrl run`: the test below
                    *fault_tools.at_test_settings([f"ledger.retry_s={RETRY_S}"])])  # fmt: skip
    retry_s = run.cfg.ledger.retry_s
    launcher = run.launcher
    launcher.start(nodes=2)
    run.wait_steps(3)
    pace = run.step_gap(run.records())
    server = launcher.redis

    killed = time.time()
    fault_tools.kill(server.pid)
    server.process.wait(timeout=10)
    time.sleep(OUTAGE_S)
    server.start()  # same port and folder: the ledger is read back from the append-only file
    run.wait_steps(3)
    stall = run.stall(killed, time.time())
    alive = [launcher.learner.alive] + [c.alive for c in launcher.nodes.values()]
    counts_back = run.ledger.counts()
    assert all(alive), alive
    assert counts_back.balance_errors() == []
    assert stall < OUTAGE_S + 3 * pace + 5.0, (stall, pace)

    gone = time.time()
    fault_tools.kill(server.pid)
    server.process.wait(timeout=10)
    code = launcher.learner.process.wait(timeout=retry_s * 3 + 30)
    learner_exit_s = time.time() - gone
    node_codes = [c.process.wait(timeout=retry_s * 4 + 60) for c in launcher.nodes.values()]
    log = run.learner_log()
    server.start()
    books = run.ledger.check(deep=True)
    counts = run.ledger.counts()
    fault_tools.figure(
        "redis_kill9",
        pace_s=round(pace, 2),
        outage_s=OUTAGE_S,
        stall_s=round(stall, 1),
        learner_exit_s=round(learner_exit_s, 1),
        learner_code=code,
        node_codes=node_codes,
        samples=counts.total,
        in_flight_at_stop=counts.in_flight,
        lost=0 if not books else books,
    )
    assert code == 4, launcher.learner.log_tail(30)
    # the URL as logged: its password (the embedded Redis has one per run) redacted
    assert re.search(rf"Redis at redis://(:\*\*\*@)?127\.0\.0\.1:{server.port}", log) and "did not answer" in log
    assert learner_exit_s < retry_s * 2 + 15
    assert all(c == 1 for c in node_codes), node_codes
    assert books == [], books  # intact: every record agrees with the counters (in flight is allowed: unfinished)
    assert run.ledger.finished() is None


@pytest.mark.vllm
@pytest.mark.slow
def test_streamrl_run_with_its_redis_gone_for_good_says_so_in_one_line_and_leaves_no_process(tmp_path, fault_tools):
    sets = [*fault_tools.run_settings, *fault_tools.at_test_settings([f"ledger.retry_s={RETRY_S}"])]
    sets += ["run.steps=100000", f"run.dir='{tmp_path}'", "run.name='lost'"]
    out = tmp_path / "run.out"
    command = [
        sys.executable,
        "-m",
        "streamrl",
        "run",
        "--rollout-nodes",
        "1",
        *(a for s in sets for a in ("--set", s)),
    ]
    env = dict(os.environ, COLUMNS="80")  # a machine that exports COLUMNS: the line must not wrap at it
    with out.open("wb") as sink:
        run = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    metrics = tmp_path / "lost" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 400
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert run.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.5)
        children = fault_tools.descendants(run.pid)
        redis = [pid for pid, line in children.items() if "redis-server" in line]
        assert len(redis) == 1 and any("rollout" in line for line in children.values()), children
        gone = time.time()
        fault_tools.kill(redis[0])
        code = run.wait(timeout=600)
        exit_s = time.time() - gone
    finally:
        if run.poll() is None:
            run.kill()
    said = out.read_text(errors="replace")
    deadline = time.monotonic() + 15  # orphans are reaped by init
    while any(fault_tools.running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: line for pid, line in children.items() if fault_tools.running(pid)}
    fault_tools.figure("run_redis_gone", exit_code=code, exit_s=round(exit_s, 1), children=len(children),
                       left=len(left), traceback="Traceback" in said)  # fmt: skip
    assert code == 4, said[-3000:]
    lines = [line for line in said.splitlines() if "stopped answering" in line]
    assert "Traceback" not in said and len(lines) == 1, said[-3000:]
    assert lines[0].startswith("error: the ledger") and "--resume latest --set run.name=lost" in lines[0], lines
    assert left == {}, left
