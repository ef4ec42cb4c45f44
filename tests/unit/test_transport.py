"""Trajectory stream and control channel over real ZMQ sockets on loopback."""

from __future__ import annotations

import socket
import time

import pytest
import zmq

from streamrl.engine import messages
from streamrl.engine.control import ControlClient, ControlServer
from streamrl.engine.messages import Register, Stop, Trajectory, Welcome
from streamrl.engine.transport import TrajectoryReceiver, TrajectorySender, TransportError


def _traj(sample_id: str = "s", completion: int = 3) -> Trajectory:
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


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def receiver():
    with TrajectoryReceiver() as r:
        yield r


def test_sender_numbers_messages_from_zero_and_fields_survive(receiver):
    with TrajectorySender(receiver.addr, "node-a", send_timeout_s=10) as sender:
        assert [sender.send(_traj(f"s{i}")) for i in range(3)] == [0, 1, 2]
        got = [receiver.recv(10) for _ in range(3)]
    assert [t.seq for t in got] == [0, 1, 2]
    assert [t.sample_id for t in got] == ["s0", "s1", "s2"]
    assert got[0].node_id == "node-a" and got[0].behavior_logprobs == [-0.5] * 3 and got[0].reward == 1.0
    assert receiver.gaps == receiver.duplicates == receiver.decode_errors == 0
    assert receiver.recv(0.05) is None


def test_receiver_counts_gaps_and_drops_duplicates(receiver):
    with TrajectorySender(receiver.addr, "node-a", send_timeout_s=10) as sender:
        sender.send(_traj("s0"))
        sender.seq = 4  # seq 1, 2, 3 never sent
        sender.send(_traj("s4"))
        sender.seq = 2  # a replay of an old number
        sender.send(_traj("again"))
        sender.seq = 5
        sender.send(_traj("s5"))
        got = [receiver.recv(10), receiver.recv(10), receiver.recv(10)]
    assert [t.sample_id for t in got] == ["s0", "s4", "s5"]
    assert receiver.gaps == 3
    assert receiver.duplicates == 1 and list(receiver.duplicate_ids) == ["again"]


def test_nodes_are_numbered_independently(receiver):
    with (
        TrajectorySender(receiver.addr, "a", send_timeout_s=10) as a,
        TrajectorySender(receiver.addr, "b", send_timeout_s=10) as b,
    ):
        a.send(_traj())
        b.send(_traj())
        a.send(_traj())
        got = sorted((t.node_id, t.seq) for t in (receiver.recv(10), receiver.recv(10), receiver.recv(10)))
    assert got == [("a", 0), ("a", 1), ("b", 0)]
    assert receiver.gaps == receiver.duplicates == 0


def test_undecodable_frame_is_counted_and_skipped(receiver):
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(receiver.addr)
    try:
        push.send(b"\x93not a trajectory")
        push.send(messages.encode(_traj("good")))
        assert receiver.recv(10).sample_id == "good"
        assert receiver.decode_errors == 1
    finally:
        push.close(linger=0)


def test_slow_consumer_blocks_sender_and_nothing_is_dropped():
    big = 200_000  # tokens per message, so socket buffers fill after a few messages
    with (
        TrajectoryReceiver(hwm=1) as receiver,
        TrajectorySender(receiver.addr, "n", hwm=1, send_timeout_s=0.5) as sender,
    ):
        sent = 0
        with pytest.raises(TransportError, match=receiver.addr.replace(".", r"\.")):
            for _ in range(200):
                sender.send(_traj(f"s{sent}", completion=big))
                sent += 1
        assert 0 < sent < 200
        seqs = [receiver.recv(10).seq for _ in range(sent)]
        assert seqs == list(range(sent))
        assert receiver.recv(0.2) is None  # the send that timed out was not delivered
        sender.send(_traj("after", completion=1))  # the sender is usable again once the consumer reads
        assert receiver.recv(10).seq == sent


def test_unreachable_learner_fails_within_the_timeout_naming_it():
    addr = f"tcp://127.0.0.1:{_dead_port()}"
    with TrajectorySender(addr, "n", send_timeout_s=0.3) as sender:
        start = time.monotonic()
        with pytest.raises(TransportError, match=f"127.0.0.1:{addr.rsplit(':', 1)[1]}.*unreachable"):
            sender.send(_traj())
        assert time.monotonic() - start < 10
    assert sender.seq == 0


def test_malformed_address_is_a_clear_error():
    with pytest.raises(TransportError, match="nonsense"):
        TrajectorySender("nonsense", "n")


def test_control_request_reply_and_pushed_messages_are_kept():
    with ControlServer() as server, ControlClient(server.addr, "node-1", timeout_s=10) as client:
        client.send(Register(node_id="node-1", host="h"))
        peer, msg, _ = server.recv(10)
        assert peer == b"node-1" and isinstance(msg, Register) and msg.host == "h"
        server.send(peer, Stop(reason="first"))
        server.send(
            peer, Welcome(node_id="node-1", trajectory_addr="tcp://x:1", redis_url="", run_name="r", policy_version=3)
        )
        reply = client.request(Register(node_id="node-1", host="h"), expect=Welcome)
        assert reply.policy_version == 3
        assert server.recv(10)[1].node_id == "node-1"
        assert client.recv(1) == Stop(reason="first")
        assert client.recv(0.05) is None
        assert server.recv(0.05) is None


def test_control_timeouts_name_the_address():
    addr = f"tcp://127.0.0.1:{_dead_port()}"
    with ControlClient(addr, "node-1", timeout_s=0.2) as client:
        with pytest.raises(TransportError, match=f"{addr}.*0.2s"):
            client.request(Register(node_id="node-1", host="h"))
    with ControlServer() as server:
        with pytest.raises(TransportError, match="not connected"):
            server.send(b"ghost", Stop(reason="x"))
        with pytest.raises(TransportError, match=server.addr.replace(".", r"\.")):
            server.recv(0.05, required=True)


def test_control_server_counts_bad_frames():
    with ControlServer() as server:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(server.addr)
        try:
            dealer.send(b"junk")
            dealer.send(messages.encode(Stop(reason="ok")))
            assert server.recv(10)[1] == Stop(reason="ok")
            assert server.decode_errors == 1
        finally:
            dealer.close(linger=0)


def test_wait_connected(receiver):
    with TrajectorySender(receiver.addr, "n", send_timeout_s=5) as sender:
        sender.wait_connected(10)
        sender.send(_traj())
        assert receiver.recv(10).seq == 0
    addr = f"tcp://127.0.0.1:{_dead_port()}"
    with TrajectorySender(addr, "n", send_timeout_s=5) as sender:
        with pytest.raises(TransportError, match=f"{addr} within 0.3s"):
            sender.wait_connected(0.3)
