"""The control channel (DEALER <-> ROUTER): registration, weights-ready, heartbeats, stop.

The learner's `ControlServer` is one ROUTER socket, every node a peer identity; a node's
`ControlClient` is a DEALER whose identity is its node id. Every wait has a timeout and errors name
the peer; frames that do not decode are counted per sender (`FaultTally`) and dropped. With a CURVE
gate (`engine/auth.py`) only nodes with an allowed key connect, and each message carries its
sender's key, which the registry checks against the key that registered the node.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, NamedTuple

import zmq

from streamrl.engine import messages
from streamrl.engine.auth import CurveGate, NodeKeys, secure_client
from streamrl.engine.faults import FAULT_LOG_INTERVAL_S, FaultTally
from streamrl.engine.messages import Control, DecodeError, Probe
from streamrl.engine.transport import (
    LOOPBACK_ANY_PORT,
    MAX_FRAME_MB,
    TransportError,
    bind_address,
    bind_socket,
    cap_frames,
    connect_socket,
    sender_key,
    timeout_ms,
)

HEARTBEAT_S = 0.5  # a node beats this often on the control channel (rollout/control.py); the learner probes one
# that missed a beat (learner/reachability.py)

# a learner with CURVE on never completes a connection with a node whose keys do not match: sends then block
_CHECK = (
    "is the learner running and the address right? is transport.curve the same on both sides, and this "
    "node's key among those the learner allows?"
)


class Incoming(NamedTuple):
    """A control message as the learner receives it: the peer's routing id, the message, and the
    sender's CURVE public key (z85; '' without CURVE)."""

    peer: bytes
    msg: Control
    key: str


class ControlServer:
    """ROUTER side of the control channel (the learner): one socket, every node a peer identity.
    With a `gate`, only CURVE clients with an allowed key connect, and each message names its key.
    `connected` tells whether the socket still has a connection to a peer (a killed node's closed at once);
    `disconnected` whether any connection closed since it was last asked (the socket's monitor says so at
    once, without saying whose: its owner then asks `connected` of each peer)."""

    def __init__(
        self,
        bind: str | int = LOOPBACK_ANY_PORT,
        send_timeout_s: float = 30.0,
        context: zmq.Context | None = None,
        max_frame_mb: float = MAX_FRAME_MB,
        fault_log_interval_s: float = FAULT_LOG_INTERVAL_S,
        gate: CurveGate | None = None,
    ):
        if isinstance(bind, int):
            bind = bind_address(port=bind)
        self._sock = (gate.context if gate else context or zmq.Context.instance()).socket(zmq.ROUTER)
        self._closed_seen = threading.Event()  # set by the gate's thread; the monitor's own reads otherwise
        self._monitor: zmq.Socket | None = None
        if gate is not None:
            gate.secure(self._sock, on_disconnect=self._closed_seen.set)  # a socket has one monitor: the gate's
        else:
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, timeout_ms(send_timeout_s))
        cap_frames(self._sock, max_frame_mb)
        self.send_timeout_s = send_timeout_s
        self.addr = bind_socket(self._sock, bind)
        self.faults = FaultTally(f"control socket {self.addr}", fault_log_interval_s)

    @property
    def decode_errors(self) -> int:
        return self.faults.count("decode_errors")

    def recv(self, timeout_s: float, required: bool = False) -> Incoming | None:
        """(peer identity, message, sender key), or None after `timeout_s` (TransportError instead when `required`)."""
        deadline = time.monotonic() + timeout_s
        while self._sock.poll(timeout_ms(deadline - time.monotonic())):
            frames = self._sock.recv_multipart(copy=False)
            peer = frames[0].bytes
            try:
                if len(frames) != 2:
                    raise DecodeError(f"{len(frames) - 1} frames, expected 1")
                return Incoming(peer, messages.decode_control(frames[1].buffer), sender_key(frames[1]))
            except DecodeError as e:
                self.faults.add(f"node {peer!r}", "decode_errors", detail=str(e))
        self.faults.flush_due()
        if required:
            raise TransportError(f"no control message on {self.addr} within {timeout_s:g}s")
        return None

    def send(self, peer: bytes, msg: Control) -> None:
        """Send to one peer; TransportError when the peer is unknown/gone or the send is blocked past the timeout."""
        try:
            self._sock.send_multipart([peer, messages.encode(msg)])
        except zmq.Again:
            raise TransportError(
                f"control send of {type(msg).__name__} to node {peer!r} on {self.addr} "
                f"blocked for {self.send_timeout_s:g}s"
            ) from None
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            raise TransportError(
                f"control send of {type(msg).__name__} on {self.addr}: node {peer!r} "
                f"is not connected (it left or never registered)"
            ) from None

    def connected(self, peer: bytes) -> bool:
        """Whether the socket holds a connection to `peer`, asked by sending it a `Probe`: with ROUTER_MANDATORY
        a send to a peer whose connection closed (the kernel closes a killed process's) fails at once
        (EHOSTUNREACH). A peer whose queue is full is connected (never waits for it). No socket monitor tells
        this: a CURVE gate's already watches the socket (`engine/auth.py`), and a socket has one."""
        try:
            self._sock.send_multipart([peer, messages.encode(Probe())], flags=zmq.NOBLOCK)
        except zmq.Again:
            return True
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    def disconnected(self) -> bool:
        """Whether a connection of the socket closed since the last call (a node killed, or gone away)."""
        while self._monitor is not None and self._monitor.poll(0):
            self._monitor.recv_multipart()  # EVENT_DISCONNECTED, or MONITOR_STOPPED as the socket closes
            self._closed_seen.set()
        seen = self._closed_seen.is_set()
        self._closed_seen.clear()
        return seen

    def close(self) -> None:
        self.faults.flush()
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ControlClient:
    """DEALER side (a rollout node). Messages that arrive while `request` waits for its reply are kept
    for `recv`, so a `Stop` or `WeightsReady` pushed by the learner is never lost."""

    def __init__(
        self,
        addr: str,
        node_id: str,
        timeout_s: float = 30.0,
        context: zmq.Context | None = None,
        max_frame_mb: float = MAX_FRAME_MB,
        fault_log_interval_s: float = FAULT_LOG_INTERVAL_S,
        keys: NodeKeys | None = None,
    ):
        self.addr, self.node_id, self.timeout_s = addr, node_id, timeout_s
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        secure_client(self._sock, keys)
        self._sock.setsockopt(zmq.IDENTITY, node_id.encode())
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, timeout_ms(timeout_s))
        cap_frames(self._sock, max_frame_mb)
        connect_socket(self._sock, addr)
        self._pending: collections.deque[Control] = collections.deque()
        self.faults = FaultTally(f"node {node_id}'s control socket", fault_log_interval_s)

    @property
    def decode_errors(self) -> int:
        return self.faults.count("decode_errors")

    def send(self, msg: Control, timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._sock.setsockopt(zmq.SNDTIMEO, timeout_ms(timeout_s))
        try:
            self._sock.send(messages.encode(msg))
        except zmq.Again:
            raise TransportError(
                f"node {self.node_id}: could not send {type(msg).__name__} to the learner at "
                f"{self.addr} within {timeout_s:g}s ({_CHECK})"
            ) from None

    def recv(self, timeout_s: float | None = None) -> Control | None:
        """The next control message (kept ones first), or None after `timeout_s`."""
        if self._pending:
            return self._pending.popleft()
        return self._recv_one(time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s))

    def _recv_one(self, deadline: float) -> Control | None:
        while self._sock.poll(timeout_ms(deadline - time.monotonic())):
            try:
                return messages.decode_control(self._sock.recv())
            except DecodeError as e:
                self.faults.add(f"the learner at {self.addr}", "decode_errors", detail=str(e))
        self.faults.flush_due()
        return None

    def request(
        self, msg: Control, timeout_s: float | None = None, expect: type | tuple[type, ...] | None = None
    ) -> Control:
        """Send `msg` and wait for the reply (the first message of type `expect`, when given)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        self.send(msg, timeout_s)
        while True:
            reply = self._recv_one(deadline)
            if reply is None:
                raise TransportError(
                    f"node {self.node_id}: no reply to {type(msg).__name__} from the learner at "
                    f"{self.addr} within {timeout_s:g}s ({_CHECK})"
                )
            if expect is None or isinstance(reply, expect):
                return reply
            self._pending.append(reply)

    def close(self) -> None:
        self.faults.flush()
        self._sock.close(linger=0)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
