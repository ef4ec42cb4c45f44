"""Who may speak on the learner's sockets, over real ZMQ sockets: CURVE keys and the ZAP gate, the
registry's binding of node ids to keys, signed trajectory frames; and the refusals at start."""

from __future__ import annotations

import stat
import time

import msgspec
import pytest
import zmq

from streamrl.engine import auth, messages
from streamrl.engine.auth import AuthError, CurveGate, Identity, NodeKeys
from streamrl.engine.config import build
from streamrl.engine.control import ControlClient, ControlServer
from streamrl.engine.messages import Goodbye, Heartbeat, Register, Stop, Trajectory, Welcome
from streamrl.engine.transport import TrajectoryReceiver, TrajectorySender, TransportError
from streamrl.learner.nodes import NodeRegistry


def _traj(sample_id: str = "s", node_id: str = "", seq: int = 0) -> Trajectory:
    return Trajectory(sample_id=sample_id, group_id="g", node_id=node_id, seq=seq, prompt_ids=[1, 2],
                      completion_ids=[3], behavior_logprobs=[-0.5], reward=1.0, policy_version=0)  # fmt: skip


@pytest.fixture
def keys(tmp_path):
    """A key folder with the shared node pair and a second node's own folder, and a gate on it."""
    root = tmp_path / "keys"
    auth.make_keys(root)
    other = auth.make_keys(root, node="node-b")
    gate = CurveGate(auth.server_keys(root), fault_log_interval_s=0.01)
    yield root, auth.node_keys(root), auth.node_keys(other), gate
    gate.close()


def _stranger_keys(server_public: bytes) -> NodeKeys:
    public, secret = zmq.curve_keypair()
    return NodeKeys(server_public, public, secret)


def test_key_folders_keep_secrets_private_and_load_back(tmp_path):
    root = tmp_path / "keys"
    assert auth.make_keys(root) == root  # the learner's pair and a node pair to share
    node_dir = auth.make_keys(root, node="n1")  # a node's own folder
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and stat.S_IMODE(node_dir.stat().st_mode) == 0o700
    for secret in (root / "server.key_secret", root / "node.key_secret", node_dir / "node.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    server = auth.server_keys(root)
    node = auth.node_keys(node_dir)
    assert node.server_public == server.public and node.public in server.allowed and len(server.allowed) == 2
    again = auth.make_keys(root, node="n1")  # idempotent: the keys already handed out stay valid
    assert auth.node_keys(again) == node and auth.server_keys(root) == server


def test_missing_keys_name_the_field_and_the_command(tmp_path):
    with pytest.raises(AuthError, match=r"transport.keys: cannot read .*server.key_secret.*streamrl keys"):
        auth.server_keys(tmp_path)
    with pytest.raises(AuthError, match=r"transport.keys: cannot read .*server.key"):
        auth.node_keys(tmp_path)


def test_an_allowed_key_registers_and_each_message_names_its_key(keys):
    root, node, _, gate = keys
    with ControlServer(gate=gate) as server, ControlClient(server.addr, "node-a", timeout_s=10, keys=node) as client:
        client.send(Register(node_id="node-a", host="h"))
        got = server.recv(10)
        assert got.peer == b"node-a" and isinstance(got.msg, Register) and got.key == node.public.decode()
    assert gate.refused() == 0


def test_strangers_never_get_a_message_through_and_are_counted(keys):
    _, node, _, gate = keys
    with ControlServer(gate=gate) as server:
        plain = ControlClient(server.addr, "plain", timeout_s=0.5)  # no CURVE at all
        unknown = ControlClient(server.addr, "unknown", timeout_s=0.5, keys=_stranger_keys(node.server_public))
        wrong_server = ControlClient(server.addr, "wrong", timeout_s=0.5, keys=_stranger_keys(zmq.curve_keypair()[0]))
        for client in (plain, unknown, wrong_server):
            with pytest.raises(TransportError):
                client.request(Register(node_id="node-a", host="h"))
        assert server.recv(0.5) is None
        deadline = time.monotonic() + 10
        while gate.faults.count("denied") < 1 or gate.faults.count("handshake_failed") < 2:
            assert time.monotonic() < deadline, gate.faults.by_sender()
            time.sleep(0.05)
        for client in (plain, unknown, wrong_server):
            client.close()
    counts = gate.faults.by_sender()
    assert sum(c.get("denied", 0) for c in counts.values()) >= 1  # the unknown key, named with its peer
    assert any(s.startswith("peer 127.0.0.1") for s, c in counts.items() if c.get("denied"))


def _receiver_with(identities: dict[str, Identity], gate=None) -> TrajectoryReceiver:
    return TrajectoryReceiver(gate=gate, identities=identities.get, fault_log_interval_s=0.01)


def test_a_forged_frame_cannot_move_another_nodes_sequence_on_loopback():
    secret_a, secret_b = auth.new_secret(), auth.new_secret()
    with _receiver_with({"a": Identity("", secret_a), "b": Identity("", secret_b)}) as rx:
        with (
            TrajectorySender(rx.addr, "a", send_timeout_s=10, secret=secret_b) as forger,  # b's secret, a's name
            TrajectorySender(rx.addr, "ghost", send_timeout_s=10, secret=secret_b) as ghost,  # never registered
            TrajectorySender(rx.addr, "a", send_timeout_s=10) as unsigned,
            TrajectorySender(rx.addr, "a", send_timeout_s=10, secret=secret_a) as real,
        ):
            forger.seq = 10**9  # the probe's blackhole: a huge seq for node a
            forger.send(_traj("forged"))
            ghost.send(_traj("ghost"))
            unsigned.seq = 10**9
            unsigned.send(_traj("unsigned"))
            time.sleep(0.2)  # the three sent first (four connections: arrival order is not guaranteed)
            real.send(_traj("real-0"))
            got = rx.recv(10)
            late = rx.recv(0.5)  # one of the three that came after the real frame is refused now
        assert got.sample_id == "real-0" and got.seq == 0 and late is None and rx.next_seq == {"a": 1}
        assert rx.gaps == 0 and rx.refused == 3
        assert rx.faults.by_sender() == {
            "node 'a' (claimed)": {"bad_signature": 2},
            "node 'ghost' (claimed)": {"unregistered": 1},
        }


def test_under_curve_a_frame_must_come_with_its_nodes_key(keys):
    _, node_a, node_b, gate = keys
    secret = auth.new_secret()
    with _receiver_with({"a": Identity(node_a.public.decode(), secret)}, gate=gate) as rx:
        with (
            TrajectorySender(rx.addr, "a", send_timeout_s=10, keys=node_b, secret=secret) as other_key,
            TrajectorySender(rx.addr, "a", send_timeout_s=10, keys=node_a, secret=secret) as real,
        ):
            other_key.seq = 10**9  # a's secret leaked to b: b's key still betrays it
            other_key.send(_traj("forged"))
            time.sleep(0.2)
            real.send(_traj("real-0"))
            got = rx.recv(10)
        assert got.sample_id == "real-0" and rx.next_seq == {"a": 1}
        assert rx.faults.by_sender() == {"node 'a' (claimed)": {"wrong_key": 1}}


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_the_registry_binds_an_id_to_its_key_and_ignores_messages_for_others(keys):
    _, node_a, node_b, gate = keys
    welcome = lambda node_id: Welcome(  # noqa: E731
        node_id=node_id, trajectory_addr="tcp://x:1", redis_url="redis://", run_name="r", policy_version=0
    )
    registry = NodeRegistry(ControlServer(gate=gate, fault_log_interval_s=0.01), welcome)
    registry.start()
    try:
        with (
            ControlClient(registry.addr, "a", timeout_s=10, keys=node_a) as a,
            ControlClient(registry.addr, "b", timeout_s=10, keys=node_b) as b,
            ControlClient(registry.addr, "a2", timeout_s=10, keys=node_b) as thief,
        ):
            got_a = a.request(Register(node_id="a", host="h"), expect=Welcome)
            got_b = b.request(Register(node_id="b", host="h"), expect=Welcome)
            assert len(got_a.secret) == 32 and got_a.secret != got_b.secret
            assert registry.identity("a") == Identity(node_a.public.decode(), got_a.secret)
            b.send(Goodbye(node_id="a", reason="spoof"))  # the probe: a stranger's Goodbye cut a node off
            b.send(Heartbeat(node_id="a", policy_version=99))
            b.send(Heartbeat(node_id="nobody", policy_version=1))
            refusal = thief.request(Register(node_id="a", host="h"), expect=(Welcome, Stop))
            assert isinstance(refusal, Stop) and "another key" in refusal.reason
            _wait_for(lambda: registry.refused() == 4)
            assert sorted(registry.take_events()) == [("joined", "a"), ("joined", "b")]  # a never "left"
            assert registry.nodes["a"].version == 0 and registry.identity("a").secret == got_a.secret
            assert registry.server.faults.by_sender() == {
                "node 'a' (claimed)": {"spoofed": 3},
                "node 'nobody' (claimed)": {"unregistered": 1},
            }
            a.send(Goodbye(node_id="a", reason="done"))  # its own goodbye is taken
            _wait_for(lambda: registry.take_events() == [("left", "a")])
            registry.forget("a")
            a.send(Heartbeat(node_id="a", policy_version=1))  # late, from the node that left: not an attack
            b.send(Heartbeat(node_id="a", policy_version=1))  # from anyone else: still refused
            _wait_for(lambda: registry.refused() == 5)
            time.sleep(0.2)
            assert registry.server.faults.by_sender()["node 'a' (claimed)"] == {"spoofed": 3, "unregistered": 1}
    finally:
        registry.close()


def test_without_curve_a_live_id_is_never_registered_again():
    welcome = lambda node_id: Welcome(  # noqa: E731
        node_id=node_id, trajectory_addr="tcp://x:1", redis_url="", run_name="r", policy_version=0
    )
    registry = NodeRegistry(ControlServer(fault_log_interval_s=0.01), welcome)
    registry.start()
    try:
        with (
            ControlClient(registry.addr, "a", timeout_s=10) as a,
            ControlClient(registry.addr, "thief", timeout_s=10) as thief,
        ):
            got = a.request(Register(node_id="a", host="h"), expect=Welcome)
            refusal = thief.request(Register(node_id="a", host="h"), expect=(Welcome, Stop))
            assert isinstance(refusal, Stop) and "live" in refusal.reason
            a.send(Heartbeat(node_id="a", policy_version=7))  # the real node still speaks for itself
            _wait_for(lambda: registry.nodes["a"].version == 7)
            assert registry.identity("a").secret == got.secret and registry.nodes["a"].peer == b"a"
            assert registry.server.faults.by_sender() == {"node 'a' (claimed)": {"spoofed": 1}}
            registry.forget("a")  # gone (left, or reaped): a restarted node may take its id again
            again = thief.request(Register(node_id="a", host="h"), expect=(Welcome, Stop))
            assert isinstance(again, Welcome) and again.secret != got.secret
    finally:
        registry.close()


def test_a_welcome_from_before_the_secret_still_decodes():
    class OldWelcome(msgspec.Struct, array_like=True, tag="welcome"):  # the field list before this change
        node_id: str
        trajectory_addr: str
        redis_url: str
        run_name: str
        policy_version: int

    frame = msgspec.msgpack.encode(OldWelcome("n", "t", "r", "x", 1))
    assert messages.decode_control(frame) == Welcome(
        node_id="n", trajectory_addr="t", redis_url="r", run_name="x", policy_version=1, secret=b""
    )


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["transport.host=10.1.2.3", "transport.curve=false"], "transport.host = '10.1.2.3'"),
        (["transport.host=0.0.0.0", "transport.curve=false"], "transport.host = '0.0.0.0'"),
        (["weights.store_host=node7.cluster", "transport.curve=false"], "weights.store_host = 'node7.cluster'"),
        (["ledger.url='redis://:pw@10.0.0.5:6379/0'"], "ledger.url = 'redis://:***@10.0.0.5"),
    ],
)
def test_listeners_beyond_loopback_are_refused_at_start_naming_the_fields(overrides, field):
    with pytest.raises(AuthError) as refused:
        auth.check_listeners(build({}, overrides))
    assert field in str(refused.value) and "pw" not in str(refused.value)
    assert "transport.curve" in str(refused.value) or "ledger.allow_plaintext" in str(refused.value)


def test_what_loopback_and_curve_allow():
    for overrides in (
        [],
        ["transport.host=localhost", "weights.store_host=127.0.0.2"],
        ["transport.host=10.1.2.3", "weights.store_host=10.1.2.3"],  # CURVE is on by default
        ["ledger.url='rediss://:pw@10.0.0.5:6379/0'"],
        ["ledger.url='redis://:pw@10.0.0.5:6379/0'", "ledger.allow_plaintext=true"],
    ):
        auth.check_listeners(build({}, overrides))


def _listen_address(port: int) -> str:
    """The local address of the socket listening on `port`, as /proc/net/tcp{,6} (`ss -ltn`) shows it."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                raw = bytes.fromhex(local.split(":")[0])
                return ".".join(str(b) for b in raw[::-1]) if len(raw) == 4 else "[" + raw.hex() + "]"
    raise AssertionError(f"nothing listens on port {port}")


def test_the_weight_store_listens_only_where_config_says():
    from streamrl.engine.weights import WeightSender

    sender = WeightSender("n", host="127.0.0.1", timeout_s=5)
    try:
        assert _listen_address(sender.port) == "127.0.0.1"  # torch alone binds [::] whatever host it is given
    finally:
        sender.close()
