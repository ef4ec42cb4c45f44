"""10,000 frames of garbage into the learner's sockets mid-run (5,000 into the trajectory stream, 5,000
into the control channel): training goes on, every frame is counted in `decode_errors` in
metrics.jsonl, and the log gets a handful of summary lines, not one per frame. The run has CURVE
turned off (else no garbage would get past the handshake), which is also where a local process could
take a node's id over: its `Register` under the live node's id is refused with a `Stop`, the node
trains on at its pace, and a new id is welcomed without the ledger's credentials."""

from __future__ import annotations

import json
import os
import time

import pytest
import zmq

from streamrl.engine.control import ControlClient
from streamrl.engine.messages import Goodbye, Register, Stop, Welcome

pytestmark = [pytest.mark.faults, pytest.mark.slow]

FRAMES = 5000  # per socket


def test_garbage_frames_mid_run_are_counted_not_logged_and_training_goes_on(fault_run, fault_tools):
    run = fault_run(["run.steps=100000", "transport.curve=false", "rollout.backend='hf'"])  # the learner is tested
    run.launcher.start(nodes=1)
    run.wait_steps(3)
    pace = run.step_gap(run.records())
    addresses = json.loads((run.run_dir / "learner.json").read_text())
    lines_before = len(run.learner_log().splitlines())
    errors_before = run.records()[-1]["decode_errors"]
    context = zmq.Context()
    push, dealer = context.socket(zmq.PUSH), context.socket(zmq.DEALER)
    try:
        push.connect(addresses["trajectory_addr"])
        dealer.connect(addresses["control_addr"])
        started = time.time()
        for i in range(FRAMES):
            push.send(os.urandom(16 + i % 200), copy=True)
            dealer.send(os.urandom(16 + i % 200), copy=True)
        run.wait(lambda: run.records()[-1]["decode_errors"] >= errors_before + 2 * FRAMES, "every frame counted", 120)
        run.wait_steps(3)
    finally:
        push.close(linger=0)
        dealer.close(linger=0)
        context.term()
    stall = run.stall(started, time.time())
    new_lines = run.learner_log().splitlines()[lines_before:]
    about_frames = [line for line in new_lines if "decode" in line or "undecodable" in line]
    counted = run.records()[-1]["decode_errors"] - errors_before
    fault_tools.figure("garbage_frames", frames=2 * FRAMES, counted=counted, log_lines=len(about_frames),
                       pace_s=round(pace, 2), stall_s=round(stall, 1))  # fmt: skip
    assert counted == 2 * FRAMES
    assert len(about_frames) <= 6, about_frames
    assert stall < 3 * pace + 5.0, (stall, pace)
    assert run.launcher.learner.alive
    _no_takeover_without_curve(run, fault_tools, addresses["control_addr"])


def _no_takeover_without_curve(run, fault_tools, control_addr: str) -> None:
    """Another local process registers under the live node's id (no key to prove anything): refused."""
    run.wait_steps(3)
    pace = run.step_gap(run.records()[-4:])
    joined = run.learner_log().count("node node-0 joined")
    started = time.time()
    with ControlClient(control_addr, "intruder", timeout_s=10) as intruder:
        refusal = intruder.request(Register(node_id="node-0", host="elsewhere"), expect=(Welcome, Stop))
        newcomer = intruder.request(Register(node_id="newcomer", host="elsewhere"), expect=(Welcome, Stop))
        intruder.send(Goodbye(node_id="newcomer", reason="probe done"))
    run.wait_steps(4)
    stall = run.stall(started, time.time())
    fault_tools.figure("id_takeover_without_curve", pace_s=round(pace, 2), stall_s=round(stall, 1),
                       refused=type(refusal).__name__)  # fmt: skip
    assert isinstance(refusal, Stop) and "live" in refusal.reason
    assert isinstance(newcomer, Welcome) and newcomer.redis_url == ""  # no ledger credentials without CURVE
    assert run.learner_log().count("node node-0 joined") == joined  # node-0 is still the one registered
    assert stall < 3 * pace + 5.0, (stall, pace)
