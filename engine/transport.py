"""ZMQ sockets of streamrl: the trajectory stream (PUSH -> PULL); the control channel is in `control.py`.

Trajectory stream: each rollout node numbers its messages (`Trajectory.seq`, contiguous from 0 per
`node_id`); the receiver counts gaps (messages that never came) and duplicates (a seq seen again),
and drops duplicates so the learner never trains a sample twice. The sender blocks at the
high-water mark (backpressure) and raises `TransportError` naming the peer when blocked past its
timeout; with `IMMEDIATE` set, nothing is queued for a peer that never connected, so an unreachable
learner fails the first send within the timeout instead of silently filling a queue.

Every wait has a timeout. Frames that do not decode are counted (`decode_errors`) and dropped.
Sockets close with linger 0, except the trajectory sender, which gives queued messages
`flush_timeout_s` to leave (dropping them at close would lose samples silently).

Garbage costs neither memory nor log: every receiving socket has a frame size cap
(`transport.max_frame_mb`, ZMQ's MAXMSGSIZE: ZMQ drops the connection of a peer that announces a
bigger frame before reading it), and bad frames, duplicates and gaps are counted per sender
(`FaultTally`) and logged as one summary line per sender at most every `fault_log_interval_s`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from streamrl.engine import messages
from streamrl.engine.auth import CurveGate, Identity, NodeKeys, frame_mac, mac_ok, secure_client
from streamrl.engine.faults import FAULT_LOG_INTERVAL_S, FaultTally
from streamrl.engine.messages import DecodeError, Trajectory

log = logging.getLogger(__name__)

LOOPBACK_ANY_PORT = "tcp://127.0.0.1:*"
MAX_FRAME_MB = 16.0  # default cap: a trajectory of 500k tokens is ~12 MiB
# what could not prove who sent it: frames and control messages (counted per sender), connections (the gate)
REFUSALS = ("unregistered", "wrong_key", "bad_signature", "spoofed", "denied", "handshake_failed")


class TransportError(RuntimeError):
    """A socket wait that ran out of time or a peer that cannot be reached; the message names the address."""


class SendTimeoutError(TransportError):
    """A trajectory the receiver did not take within the send timeout (not sent; the same call may be retried)."""


def timeout_ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


def _endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def bind_socket(sock: zmq.Socket, addr: str) -> str:
    try:
        sock.bind(addr)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise TransportError(
            f"cannot bind {addr}: {e} (is the port taken? use port 0 or 'tcp://127.0.0.1:*' to pick a free one)"
        ) from None
    return _endpoint(sock)


def connect_socket(sock: zmq.Socket, addr: str) -> None:
    try:
        sock.connect(addr)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise TransportError(f"cannot connect to {addr}: {e} (expected tcp://HOST:PORT)") from None


def bind_address(host: str = "127.0.0.1", port: int = 0) -> str:
    """`tcp://host:port`, with port 0 meaning 'any free port' (ZMQ's `*`)."""
    return f"tcp://{host}:{port if port else '*'}"


def sender_key(frame: zmq.Frame) -> str:
    """The sender's CURVE public key (z85) that the gate tagged the frame with; '' without CURVE."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:  # no metadata on a frame of a socket without a ZAP handler
        return ""


def cap_frames(sock: zmq.Socket, max_frame_mb: float) -> int:
    if max_frame_mb <= 0:
        raise ValueError(f"transport.max_frame_mb = {max_frame_mb}: must be > 0")
    cap = int(max_frame_mb * (1 << 20))
    sock.setsockopt(zmq.MAXMSGSIZE, cap)
    return cap


# ---- trajectory stream ---------------------------------------------------------------------------


class TrajectorySender:
    """PUSH side of the trajectory stream: numbers messages per node and blocks at the high-water mark."""

    def __init__(
        self,
        addr: str,
        node_id: str,
        hwm: int = 1000,
        send_timeout_s: float = 60.0,
        flush_timeout_s: float = 5.0,
        context: zmq.Context | None = None,
        max_frame_mb: float = MAX_FRAME_MB,
        keys: NodeKeys | None = None,
        secret: bytes = b"",
    ):
        if hwm < 1 or send_timeout_s <= 0:
            raise ValueError(f"hwm={hwm} must be >= 1 and send_timeout_s={send_timeout_s} > 0")
        self.addr, self.node_id, self.max_frame_mb = addr, node_id, max_frame_mb
        self.send_timeout_s, self.flush_timeout_s = send_timeout_s, flush_timeout_s
        self.seq = 0  # the number the next message gets
        self.secret = secret  # from this node's Welcome: signs every frame (a new Welcome brings a new one)
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        secure_client(self._sock, keys)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, timeout_ms(send_timeout_s))
        self._monitor: zmq.Socket | None = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            self._sock.connect(addr)
        except zmq.ZMQError as e:
            self.close()
            raise TransportError(f"cannot connect to {addr}: {e} (expected tcp://HOST:PORT)") from None

    def wait_connected(self, timeout_s: float) -> None:
        """Return once the connection to the receiver is up (handshake done: keys accepted under CURVE);
        TransportError naming it after `timeout_s`."""
        from zmq.utils.monitor import recv_monitor_message

        deadline = time.monotonic() + timeout_s
        while self._monitor is not None and self._monitor.poll(timeout_ms(deadline - time.monotonic())):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._close_monitor()
        if self._monitor is not None:
            raise TransportError(
                f"node {self.node_id}: no connection to the learner's trajectory socket at "
                f"{self.addr} within {timeout_s:g}s (is the learner running and the address right? is "
                "transport.curve the same on both sides, and this node's key among those the learner allows?)"
            )

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def send(self, traj: Trajectory) -> int:
        """Stamp `traj` with this node's id and next seq, send it, return the seq. Blocks at the HWM."""
        traj.node_id, traj.seq = self.node_id, self.seq
        frame = messages.encode(traj)
        if len(frame) > self.max_frame_mb * (1 << 20):
            # The learner would drop the connection on it (MAXMSGSIZE) and the sample would vanish.
            raise TransportError(
                f"node {self.node_id}: trajectory {traj.sample_id} is {len(frame) / (1 << 20):.1f} MiB, over "
                f"transport.max_frame_mb = {self.max_frame_mb:g} (the learner's cap); raise it on both sides "
                f"or lower model.max_model_len"
            )
        try:
            if self.secret:
                self._sock.send_multipart([frame, frame_mac(self.secret, frame)], copy=False)
            else:
                self._sock.send(frame, copy=False)
        except zmq.Again:
            raise SendTimeoutError(
                f"node {self.node_id}: trajectory {traj.sample_id} (seq {self.seq}) not accepted by {self.addr} "
                f"within {self.send_timeout_s:g}s: the learner is unreachable or stopped reading "
                f"(check the address and that the learner runs; raise transport.send_timeout_s "
                f"if it is only slow)"
            ) from None
        self.seq += 1
        return self.seq - 1

    def close(self) -> None:
        self._close_monitor()
        self._sock.close(linger=timeout_ms(self.flush_timeout_s))

    def __enter__(self) -> TrajectorySender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TrajectoryReceiver:
    """PULL side: decodes trajectories, drops and counts undecodable frames, gaps and duplicates per node.

    A duplicate (a seq at or below one already received from that node) is counted, its sample id
    kept in `duplicate_ids` (the newest 1000), and it is not returned. A gap (seq beyond the next
    expected one) counts the missing messages in `gaps`, and the trajectory itself is returned.

    With `identities` (the learner's registry: node id -> `Identity`, None when not registered),
    a frame is admitted only from its node: registered, sent under the node's CURVE key (when the
    `gate` is on) and signed with the node's secret. Anything else is counted per claimed node
    (`unregistered`, `wrong_key`, `bad_signature`) and dropped before it touches any node's
    sequence numbers. Without `identities` every decodable frame is taken at its word (tests, tools).
    """

    def __init__(
        self,
        bind_addr: str | int = LOOPBACK_ANY_PORT,
        hwm: int = 1000,
        context: zmq.Context | None = None,
        max_frame_mb: float = MAX_FRAME_MB,
        fault_log_interval_s: float = FAULT_LOG_INTERVAL_S,
        gate: CurveGate | None = None,
        identities: Callable[[str], Identity | None] | None = None,
    ):
        if isinstance(bind_addr, int):
            bind_addr = bind_address(port=bind_addr)
        self._sock = (gate.context if gate else context or zmq.Context.instance()).socket(zmq.PULL)
        if gate is not None:
            gate.secure(self._sock)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self.max_frame_bytes = cap_frames(self._sock, max_frame_mb)
        self.addr = bind_socket(self._sock, bind_addr)
        self.faults = FaultTally(f"trajectory socket {self.addr}", fault_log_interval_s)
        self.identities = identities
        self.received = 0
        self.duplicate_ids: collections.deque[str] = collections.deque(maxlen=1000)
        self.next_seq: dict[str, int] = {}

    @property
    def decode_errors(self) -> int:
        return self.faults.count("decode_errors")

    @property
    def duplicates(self) -> int:
        return self.faults.count("duplicates")

    @property
    def gaps(self) -> int:
        return self.faults.count("gaps")

    @property
    def refused(self) -> int:
        """Frames dropped because they could not prove they came from their node."""
        return sum(self.faults.count(kind) for kind in REFUSALS)

    def recv(self, timeout_s: float) -> Trajectory | None:
        """The next new trajectory, or None when none came within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        try:
            while self._sock.poll(timeout_ms(deadline - time.monotonic())):
                frames = self._sock.recv_multipart(copy=False)
                traj = self._decode(frames[0])
                if traj is not None and self._authentic(traj, frames) and self._admit(traj):
                    self.received += 1
                    return traj
            return None
        finally:
            self.faults.flush_due()

    def _decode(self, frame: zmq.Frame) -> Trajectory | None:
        try:
            return messages.decode_trajectory(frame.buffer)
        except DecodeError as e:
            # A PULL socket does not know its peers; a frame that does not decode names no node either.
            sender = f"peer {frame.get('Peer-Address') or '?'}"
            self.faults.add(sender, "decode_errors", detail=f"{len(frame.buffer)} bytes: {e}")
            return None

    def _authentic(self, traj: Trajectory, frames: list[zmq.Frame]) -> bool:
        """The frame came from the node it names (always true without `identities`)."""
        if self.identities is None:
            return True
        who, body = self.identities(traj.node_id), frames[0]
        kind = ""
        if who is None:
            kind = "unregistered"
        elif who.key and sender_key(body) != who.key:
            kind = "wrong_key"
        elif len(frames) != 2 or not mac_ok(who.secret, body.buffer, frames[1].buffer):
            kind = "bad_signature"
        if kind:
            detail = f"sample {traj.sample_id} seq {traj.seq} from peer {body.get('Peer-Address') or '?'}"
            self.faults.add(f"node {traj.node_id!r} (claimed)", kind, detail=detail)
        return not kind

    def _admit(self, traj: Trajectory) -> bool:
        expected = self.next_seq.get(traj.node_id, 0)
        if traj.seq < expected:
            self.duplicate_ids.append(traj.sample_id)
            detail = f"seq {traj.seq}, expected {expected}, sample {traj.sample_id}"
            self.faults.add(f"node {traj.node_id}", "duplicates", detail=detail)
            return False
        if traj.seq > expected:
            detail = f"seq {expected}..{traj.seq - 1} never arrived"
            self.faults.add(f"node {traj.node_id}", "gaps", traj.seq - expected, detail=detail)
        self.next_seq[traj.node_id] = traj.seq + 1
        return True

    def close(self) -> None:
        self.faults.flush()
        self._sock.close(linger=0)

    def __enter__(self) -> TrajectoryReceiver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
