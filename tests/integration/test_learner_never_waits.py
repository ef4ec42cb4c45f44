"""A node that registers and never receives weights costs the learner nothing: it keeps stepping with the
real node, and the silent one is evicted once, after one deadline (`weights.timeout_s`).

A real run (embedded Redis, learner process, one hf node: the learner is what is tested) plus a stand-in node in
this process that registers over the real control socket, beats, and ignores every `WeightsReady`.
"""

from __future__ import annotations

import re
import threading
import time

import pytest

from streamrl.engine.auth import node_keys
from streamrl.engine.config import build
from streamrl.engine.control import ControlClient
from streamrl.engine.messages import Heartbeat, Register, Stop, Welcome
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher
from streamrl.ops.run import DEMO

pytestmark = [pytest.mark.slow]

DEADLINE_S = 6.0


def _silent_node(addr: str, keys, stop: threading.Event, got: list) -> None:
    client = ControlClient(addr, "silent", timeout_s=30.0, keys=keys)
    try:
        welcome = client.request(Register(node_id="silent", host="test"), expect=(Welcome, Stop))
        got.append(welcome)
        while not stop.is_set():
            client.send(Heartbeat(node_id="silent", policy_version=0), timeout_s=1.0)
            msg = client.recv(0.5)
            if msg is not None:
                got.append(msg)  # a WeightsReady is never answered; a Stop ends the stand-in
                if isinstance(msg, Stop):
                    return
    finally:
        client.close()


def test_a_silent_node_is_evicted_after_one_deadline_while_the_learner_keeps_stepping(tmp_path):
    sets = [*DEMO, f"run.dir='{tmp_path}'", "run.name='never-waits'", "run.steps=400", "run.device='cpu'"]
    sets += [f"weights.timeout_s={DEADLINE_S}", "telemetry.tensorboard=false", "rollout.backend='hf'"]
    launcher = Launcher(build({}, sets))
    stop, got = threading.Event(), []
    try:
        launcher.start(nodes=1)
        addr = launcher.wait_for_learner(60)["control_addr"]
        keys = node_keys(launcher.run_dir / "keys")  # the run's own (CURVE is on): the stand-in is one of its nodes
        thread = threading.Thread(target=_silent_node, args=(addr, keys, stop, got), daemon=True)
        thread.start()
        log = launcher.run_dir / "logs" / "learner-rank0.log"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and "evicted node silent" not in log.read_text():
            assert launcher.learner.alive, launcher.learner.log_tail(40)
            time.sleep(0.5)
        text = log.read_text()
        assert "evicted node silent" in text, text[-3000:]
        steps_after = len(read_metrics(launcher.run_dir / "metrics.jsonl"))
        still = time.monotonic() + 60  # a step is ~1 s idle, several under load: wait for one, not a fixed 3 s
        while len(read_metrics(launcher.run_dir / "metrics.jsonl")) <= steps_after and time.monotonic() < still:
            assert launcher.learner.alive, launcher.learner.log_tail(40)
            time.sleep(0.5)
        assert len(read_metrics(launcher.run_dir / "metrics.jsonl")) > steps_after  # still training
    finally:
        stop.set()
        launcher.stop_all()
    joined = _log_time(text, "node silent joined")
    evicted = _log_time(text, "evicted node silent")
    steps = [r for r in read_metrics(launcher.run_dir / "metrics.jsonl")]
    pushed = min(r["time"] for r in steps if r["time"] > joined)  # the first version the silent node was sent
    during = [r for r in steps if pushed < r["time"] < evicted]
    print({"push_to_evicted_s": evicted - pushed, "steps_meanwhile": len(during)})
    assert evicted - pushed < DEADLINE_S + 5  # one deadline (and a poll), not one per phase or bucket
    assert len(during) >= 2  # the learner trained on while the silent node held its transfer
    assert any(getattr(m, "reason", "").startswith("evicted") for m in got)  # and it was told


def _log_time(text: str, needle: str) -> float:
    line = next(line for line in text.splitlines() if needle in line)
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
    return time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1000
