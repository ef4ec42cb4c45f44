"""10,000 frames of garbage into the learner's sockets mid-run (5,000 into the trajectory stream, 5,000
into the control channel): training goes on, every frame is counted in `decode_errors` in
metrics.jsonl, and the log gets a handful of summary lines, not one per frame."""

from __future__ import annotations

import json
import os
import time

import pytest
import zmq

pytestmark = [pytest.mark.faults, pytest.mark.vllm, pytest.mark.slow]

FRAMES = 5000  # per socket


def test_garbage_frames_mid_run_are_counted_not_logged_and_training_goes_on(fault_run, fault_tools):
    run = fault_run(["run.steps=100000"])
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
