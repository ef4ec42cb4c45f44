"""Who may speak on the learner's sockets: CURVE keys, the ZAP gate, per-node frame signatures.

Two layers, so that no peer can speak for another node:
- **CURVE** (ZMQ's encryption and authentication; on whenever a socket binds beyond loopback): the
  learner holds a server key pair, nodes hold their own key pairs and the learner's public key.
  `CurveGate` answers ZMQ's authentication requests (ZAP) on the learner's sockets: a connection
  whose key is not in the allowed folder is refused and counted, and every admitted message
  carries its sender's public key (`frame.get("User-Id")`). The registry binds a node id to the key
  that registered it.
- **A per-node secret** issued in each node's `Welcome` (over CURVE, or loopback): a node signs each
  trajectory frame with it (`frame_mac`, HMAC-SHA256, sent as a second ZMQ frame), so even nodes
  that share one key, or any local process on loopback without CURVE, cannot forge another node's
  frames.

Key folders (`streamrl keys DIR`), in the format of `zmq.auth` (ZeroMQ certificates):
`server.key` (the learner's public key: give it to nodes), `server.key_secret` (learner only),
`node.key` / `node.key_secret` (a node's pair), `authorized/*.key` (node public keys the learner lets
in). One folder serves both roles on one host; across hosts copy the learner's half and the nodes'.
Secret files are written 0600 in a 0700 folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import pathlib
import threading
import urllib.parse
from collections.abc import Callable

import zmq
import zmq.auth
from zmq.utils import z85 as zmq_z85

from streamrl.engine.config import Config, ConfigError
from streamrl.engine.faults import FAULT_LOG_INTERVAL_S, FaultTally

log = logging.getLogger("streamrl.engine.transport")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP RFC: where libzmq asks its context's gate
ZAP_DOMAIN = b"streamrl"
# a peer that spoke ZMTP without CURVE or with the wrong server key; not NO_DETAIL (a peer that hung up
# before its greeting: a port check, a health probe)
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class AuthError(ConfigError):
    """Keys missing or unreadable, or a listener that would be open beyond loopback; names the field and the fix."""


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or `localhost`; anything else (0.0.0.0, a hostname, a LAN address) is beyond it."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---- per-node secret: trajectory frames signed by their node ------------------------------------


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a registered node proves on every frame: its CURVE key (z85 text, '' without CURVE) and
    the secret its Welcome carried."""

    key: str
    secret: bytes


def new_secret() -> bytes:
    return os.urandom(32)


def frame_mac(secret: bytes, body: bytes | memoryview) -> bytes:
    """HMAC-SHA256 of a trajectory frame under its node's secret (32 bytes, the frame after it)."""
    return hmac.new(secret, body, hashlib.sha256).digest()


def mac_ok(secret: bytes, body: bytes | memoryview, mac: bytes | memoryview) -> bool:
    return hmac.compare_digest(frame_mac(secret, body), bytes(mac))


# ---- key folders ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allowed: frozenset[bytes]  # node public keys (z85) the learner lets in


@dataclasses.dataclass(frozen=True)
class NodeKeys:
    server_public: bytes
    public: bytes
    secret: bytes


def _write_key(path: pathlib.Path, public: bytes, secret: bytes | None = None) -> None:
    lines = ["# streamrl CURVE key (ZeroMQ certificate)", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret is not None else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


def _pair(folder: pathlib.Path, name: str) -> bytes:
    """Write `name.key` and `name.key_secret` in `folder` unless they exist; the public key."""
    if not (folder / f"{name}.key_secret").exists():
        public, secret = zmq.curve_keypair()
        _write_key(folder / f"{name}.key_secret", public, secret)
        (folder / f"{name}.key").unlink(missing_ok=True)
        _write_key(folder / f"{name}.key", public)
    return zmq.auth.load_certificate(folder / f"{name}.key_secret")[0]


def make_keys(folder: str | os.PathLike, node: str = "") -> pathlib.Path:
    """The learner's pair and one node pair in `folder` (kept when present), the node's public key
    authorized. With `node`, a node's own folder `folder/node` (its pair and the learner's public
    key, ready to copy to that node's host) instead of the shared node pair. Returns the node's folder."""
    root = pathlib.Path(folder)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    (root / "authorized").mkdir(mode=0o755, exist_ok=True)
    server_public = _pair(root, "server")
    where = root / node if node else root
    if node:
        if "/" in node or node.startswith("."):
            raise AuthError(f"node name {node!r}: use a plain name (letters, digits, - and _)")
        where.mkdir(mode=0o700, exist_ok=True)
        if not (where / "server.key").exists():
            _write_key(where / "server.key", server_public)
    public = _pair(where, "node")
    authorized = root / "authorized" / f"{node or 'node'}.key"
    if not authorized.exists():
        _write_key(authorized, public)
    return where


def _load(path: pathlib.Path, field: str, want_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise AuthError(f"{field}: cannot read {path} ({e}); make keys with `streamrl keys {path.parent}`") from None
    if want_secret and secret is None:
        raise AuthError(f"{field}: {path} holds no secret key (expected a .key_secret file)")
    return public, secret


def server_keys(folder: str | os.PathLike, field: str = "transport.keys") -> ServerKeys:
    root = pathlib.Path(folder)
    public, secret = _load(root / "server.key_secret", field, want_secret=True)
    allowed = frozenset(_load(p, field, False)[0] for p in sorted((root / "authorized").glob("*.key")))
    if not allowed:
        raise AuthError(
            f"{field} = {str(folder)!r}: no node keys in {root / 'authorized'}, so no node could connect; "
            f"add one with `streamrl keys {folder} --node NAME`"
        )
    return ServerKeys(public, secret, allowed)


def node_keys(folder: str | os.PathLike, field: str = "transport.keys") -> NodeKeys:
    root = pathlib.Path(folder)
    server_public, _ = _load(root / "server.key", field, want_secret=False)
    public, secret = _load(root / "node.key_secret", field, want_secret=True)
    return NodeKeys(server_public, public, secret)


def secure_client(sock: zmq.Socket, keys: NodeKeys | None) -> None:
    """Make `sock` (before it connects) a CURVE client of the learner; nothing without keys."""
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.server_public, keys.public, keys.secret


# ---- the learner's gate --------------------------------------------------------------------------


class CurveGate:
    """The learner's CURVE keys and its ZAP handler, on a ZMQ context of its own.

    Sockets made on `context` and passed through `secure` (before they bind) accept only CURVE
    clients whose public key is allowed; the gate counts refusals per peer address (`faults`: kinds
    `denied` for a key not allowed, `handshake_failed` for a peer without CURVE or with a wrong server
    key) and tags every admitted message with its sender's key (z85 text) as `User-Id`."""

    def __init__(self, keys: ServerKeys, fault_log_interval_s: float = FAULT_LOG_INTERVAL_S):
        self.keys = keys
        self.context = zmq.Context()
        self.faults = FaultTally("CURVE gate", fault_log_interval_s)
        self._zap = self.context.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)  # before any CURVE socket binds: libzmq admits all when no gate listens
        self._monitors: list[zmq.Socket] = []
        self._on_disconnect: dict[zmq.Socket, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def secure(self, sock: zmq.Socket, on_disconnect: Callable[[], None] | None = None) -> None:
        """Make `sock` (made on `self.context`, not yet bound) a CURVE server behind this gate. The gate's
        monitor is the socket's only one: `on_disconnect` is called (on the gate's thread) when a connection
        of the socket closes, for its owner's use (engine/control.py)."""
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
        sock.zap_domain = ZAP_DOMAIN
        events = _HANDSHAKE_EVENTS | (zmq.EVENT_DISCONNECTED if on_disconnect else 0)
        with self._lock:  # the gate's thread reads the monitor: a refused handshake reaches no socket reader
            monitor = sock.get_monitor_socket(events)
            self._monitors.append(monitor)
            if on_disconnect is not None:
                self._on_disconnect[monitor] = on_disconnect

    def refused(self) -> int:
        return self.faults.count("denied") + self.faults.count("handshake_failed")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        watched: set[zmq.Socket] = set()
        while not self._stopping.is_set():
            with self._lock:
                monitors = set(self._monitors)
            for sock in monitors - watched:
                poller.register(sock, zmq.POLLIN)
                watched.add(sock)
            for sock, _ in poller.poll(100):
                if sock is self._zap:
                    self._answer(self._zap.recv_multipart())
                else:
                    self._monitored(sock)
            self.faults.flush_due()

    def _answer(self, request: list[bytes]) -> None:
        """One ZAP request (RFC 27): version, id, domain, address, identity, mechanism, credentials.
        The reply's user id (the key, z85) becomes each admitted message's `User-Id`."""
        version, request_id = (request + [b"1.0", b""])[:2]
        mechanism, key = (request[5], request[6]) if len(request) >= 7 else (b"?", b"")
        z85 = zmq_z85.encode(key) if mechanism == b"CURVE" and len(key) == 32 else b""
        if z85 and z85 in self.keys.allowed:
            self._zap.send_multipart([version, request_id, b"200", b"OK", z85, b""])
            return
        who = f"peer {request[3].decode(errors='replace') if len(request) > 3 else '?'}"
        self.faults.add(who, "denied", detail=f"{mechanism.decode(errors='replace')} key {z85.decode() or '-'}")
        self._zap.send_multipart([version, request_id, b"400", b"key not allowed", b"", b""])

    def _monitored(self, monitor: zmq.Socket) -> None:
        """One event of a secured socket: a failed handshake counted, a closed connection told its owner."""
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(monitor.recv_multipart())
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self._on_disconnect[monitor]()
        elif event["event"] & _HANDSHAKE_EVENTS:  # not MONITOR_STOPPED, sent when a socket closes
            where = f"a peer of {event['endpoint'].decode(errors='replace')}"
            self.faults.add(where, "handshake_failed", detail=f"ZMQ protocol error {event['value']:#x}")

    def close(self) -> None:
        """After the secured sockets are closed."""
        self._stopping.set()
        self._thread.join(timeout=5.0)
        self.faults.flush()
        with self._lock:
            for sock in self._monitors:
                sock.close(linger=0)
        self._zap.close(linger=0)
        self.context.destroy(linger=0)  # also any secured socket a failed start left open


# ---- from config: refuse open listeners, find the keys ---------------------------------------------


def check_listeners(cfg: Config) -> None:
    """Refuse, naming the fields, a listener or a ledger connection that would be open beyond loopback."""
    from streamrl.engine.redis_server import redact  # here: the sockets need no Redis client

    if not cfg.transport.curve:
        for field, host in (("transport.host", cfg.transport.host), ("weights.store_host", cfg.weights.store_host)):
            if not is_loopback(host):
                raise AuthError(
                    f"{field} = {host!r} is beyond loopback while transport.curve = false: anyone who reaches it "
                    "could register, inject trajectories and read the run's credentials; set transport.curve = "
                    f"true and transport.keys = a folder made by `streamrl keys DIR`, or {field} = '127.0.0.1'"
                )
    url = urllib.parse.urlsplit(cfg.ledger.url)
    if url.scheme == "redis" and url.hostname and not is_loopback(url.hostname) and not cfg.ledger.allow_plaintext:
        raise AuthError(
            f"ledger.url = {redact(cfg.ledger.url)!r}: redis:// beyond loopback sends the password and every "
            "record in clear; use rediss:// (TLS), or set ledger.allow_plaintext = true on a network only "
            "the run can reach"
        )


NO_CURVE_WARNING = (
    "transport.curve = false: the control and trajectory sockets take any local process; node ids are "
    "held by first registration alone and nodes get no ledger credentials from the learner"
)


def keys_folder(cfg: Config) -> pathlib.Path:
    """`transport.keys`, else the run's own keys in RUN/keys (made by the learner: one-host runs)."""
    return pathlib.Path(cfg.transport.keys) if cfg.transport.keys else cfg.run.path / "keys"


def open_gate(cfg: Config) -> CurveGate | None:
    """The learner's gate when `transport.curve` is on (None otherwise), after `check_listeners`."""
    check_listeners(cfg)
    if not cfg.transport.curve:
        log.warning(NO_CURVE_WARNING)
        return None
    folder = keys_folder(cfg)
    if not cfg.transport.keys:
        make_keys(folder)
    return CurveGate(server_keys(folder), cfg.transport.fault_log_interval_s)


def client_keys(cfg: Config) -> NodeKeys | None:
    """A node's keys when `transport.curve` is on (None otherwise)."""
    return node_keys(keys_folder(cfg)) if cfg.transport.curve else None
