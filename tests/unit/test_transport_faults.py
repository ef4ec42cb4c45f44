"""Garbage on the trajectory socket, over real ZMQ sockets: counted exactly per sender, logged as a few
summary lines, and a frame over the size cap dropped before it costs the receiver its size in memory."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import time

import pytest
import zmq

from streamrl.engine.messages import Trajectory
from streamrl.engine.transport import TrajectoryReceiver, TrajectorySender, TransportError

MiB = 1 << 20


def _traj(sample_id: str, completion: int = 3) -> Trajectory:
    return Trajectory(
        sample_id=sample_id,
        group_id="g",
        node_id="",
        seq=0,
        prompt_ids=[1, 2],
        completion_ids=list(range(completion)),
        behavior_logprobs=[-0.5] * completion,
        reward=1.0,
        policy_version=0,
    )


def _read_until(receiver: TrajectoryReceiver, trajectories: int, decode_errors: int, timeout_s: float = 30) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while (len(got) < trajectories or receiver.decode_errors < decode_errors) and time.monotonic() < deadline:
        traj = receiver.recv(0.2)
        if traj is not None:
            got.append(traj)
    return got


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "streamrl.engine.transport"]


def test_ten_thousand_garbage_frames_are_counted_exactly_and_logged_in_a_few_lines(caplog):
    rng = random.Random(0)
    with caplog.at_level(logging.WARNING), TrajectoryReceiver() as receiver:
        garbage = zmq.Context.instance().socket(zmq.PUSH)
        garbage.setsockopt(zmq.SNDHWM, 0)  # queue all 10k here: nothing reads before they are sent
        garbage.connect(receiver.addr)
        for _ in range(10_000):
            garbage.send(rng.randbytes(rng.randint(0, 64)))
        with TrajectorySender(receiver.addr, "node-a", send_timeout_s=10) as sender:
            sender.send(_traj("s0"))
            sender.seq = 4  # seq 1, 2, 3 never sent
            sender.send(_traj("s4"))
            sender.seq = 2  # a replay
            sender.send(_traj("again"))
            got = _read_until(receiver, 2, 10_000)
        garbage.close(linger=0)
        assert [t.sample_id for t in got] == ["s0", "s4"]
        assert (receiver.decode_errors, receiver.gaps, receiver.duplicates) == (10_000, 3, 1)
        assert receiver.faults.by_sender() == {
            "peer 127.0.0.1": {"decode_errors": 10_000},
            "node node-a": {"gaps": 3, "duplicates": 1},
        }
        assert len(_warnings(caplog)) == 2  # each sender's first fault, at once
    lines = _warnings(caplog)  # closing wrote what was still unlogged
    assert len(lines) == 4, lines
    assert any("from peer 127.0.0.1: 1 undecodable frames (first: " in line for line in lines[:2]), lines
    assert any("from peer 127.0.0.1" in line and ": 9999 undecodable frames" in line for line in lines[2:]), lines


def test_a_sender_is_logged_at_most_once_per_interval(caplog):
    with caplog.at_level(logging.WARNING), TrajectoryReceiver(fault_log_interval_s=0.5) as receiver:
        garbage = zmq.Context.instance().socket(zmq.PUSH)
        garbage.connect(receiver.addr)
        for _ in range(300):
            garbage.send(b"\xc1")  # never valid msgpack
        _read_until(receiver, 0, 300)
        assert len(_warnings(caplog)) == 1
        time.sleep(0.6)
        receiver.recv(0.01)  # reading the socket logs a summary that has come due, with nothing new
        lines = _warnings(caplog)
        assert len(lines) == 2 and "in the last 1 s: 299 undecodable frames" in lines[1], lines
        garbage.close(linger=0)


_SENDER = """
import sys, time, zmq
from streamrl.engine import messages
from streamrl.engine.messages import Trajectory
push = zmq.Context.instance().socket(zmq.PUSH)
push.connect(sys.argv[1])
push.send(b"x" * (int(sys.argv[2]) << 20))
time.sleep(1.0)  # the receiver may have dropped the connection; ZMQ reconnects by itself
push.send(messages.encode(Trajectory(sample_id="after", group_id="g", node_id="n", seq=0, prompt_ids=[1],
          completion_ids=[2], behavior_logprobs=[-1.0], reward=1.0, policy_version=0)))
push.close(linger=10_000)
"""


def _peak_growth(max_frame_mb: float, frame_mb: int) -> tuple[int, TrajectoryReceiver]:
    """Bytes the receiver's peak RSS grew by while a frame of `frame_mb` MiB (not a trajectory) and
    then a valid trajectory were sent to it from another process."""
    with TrajectoryReceiver(max_frame_mb=max_frame_mb) as receiver:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
        before = _status_kib("VmRSS")
        sender = subprocess.run([sys.executable, "-c", _SENDER, receiver.addr, str(frame_mb)], timeout=60)
        got = _read_until(receiver, 1, 0)
        assert sender.returncode == 0 and [t.sample_id for t in got] == ["after"]
        return (_status_kib("VmHWM") - before) * 1024, receiver


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset the peak RSS")
def test_a_frame_over_the_cap_is_dropped_without_costing_its_size_in_memory():
    grown, receiver = _peak_growth(max_frame_mb=1, frame_mb=64)
    assert grown < 8 * MiB, f"peak RSS grew {grown / MiB:.1f} MiB for a 64 MiB frame over a 1 MiB cap"
    assert receiver.decode_errors == 0  # never read: ZMQ dropped the connection at the frame's header
    uncapped, receiver = _peak_growth(max_frame_mb=128, frame_mb=64)  # what the cap saves
    assert uncapped > 60 * MiB and receiver.decode_errors == 1
    print(f"64 MiB frame: peak RSS +{grown / MiB:.1f} MiB under a 1 MiB cap, +{uncapped / MiB:.1f} MiB without")


def test_a_node_refuses_to_send_a_frame_over_the_cap():
    with TrajectoryReceiver() as receiver, TrajectorySender(receiver.addr, "node-a", max_frame_mb=0.001) as sender:
        with pytest.raises(TransportError, match=r"over transport.max_frame_mb = 0.001"):
            sender.send(_traj("big", completion=200))
        assert sender.seq == 0  # nothing was numbered: no gap for the learner to see
