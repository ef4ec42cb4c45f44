"""How a rollout node finds and joins its run's learner: the address (`resolve_learner`, from the run
folder's `learner.json`), a quick reachability check before the model loads (`check_reachable`), the
`Register` → `Welcome` exchange (`register`) and the ledger's URL the Welcome gives (`ledger_url`)."""

from __future__ import annotations

import json
import pathlib
import socket

from streamrl.engine.config import Config, ConfigError
from streamrl.engine.control import ControlClient
from streamrl.engine.messages import Register, Stop, Welcome
from streamrl.engine.transport import TransportError
from streamrl.engine.weights.paths import here


def resolve_learner(learner: str, cfg: Config) -> str:
    """A control address as given, or the one the run's learner wrote into `RUN/learner.json`."""
    if learner.startswith(("tcp://", "ipc://")):
        return learner
    path = pathlib.Path(learner) if learner else cfg.run.path / "learner.json"
    if path.is_dir():
        path = path / "learner.json"
    try:
        return json.loads(path.read_text())["control_addr"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"--learner {learner or '(empty)'}: no learner address at {path} ({e}); give "
            "tcp://HOST:PORT or the run folder of a running learner"
        ) from None


def register(
    client: ControlClient, node_id: str, backend: str, device: str, timeout_s: float, relays: bool = False
) -> Welcome:
    where = here(device)  # the learner picks the weights' path from it (its own GPU: CUDA IPC)
    welcome = client.request(
        Register(
            node_id=node_id,
            host=where.host,
            device=device,
            backend=backend,
            boot_id=where.boot_id,
            gpu_uuid=where.gpu_uuid,
            relays=relays,  # its receiver runs in this process: it can forward versions (rollout/control.py)
        ),  # fmt: skip
        timeout_s=timeout_s,
        expect=(Welcome, Stop),
    )
    if isinstance(welcome, Stop):
        raise TransportError(f"the learner refused node {node_id}: {welcome.reason}")
    return welcome


def check_reachable(addr: str, timeout_s: float) -> None:
    """A TCP connection to the learner's control address, before the model is loaded: a wrong
    address fails in seconds, naming it, instead of after the engine's start."""
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    if not addr.startswith("tcp://") or not port.isdigit():
        return  # ipc:// and friends: the registration's own deadline applies
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise TransportError(
            f"no learner at {addr} within {timeout_s:g}s ({e.strerror or e}): is the learner running "
            "and the address right? (`streamrl rollout --learner RUN_FOLDER` reads it from the run folder)"
        ) from None


def ledger_url(cfg: Config, welcome: Welcome) -> str:
    """The ledger's URL: from the Welcome (only sent over CURVE), else this node's own `ledger.url`."""
    if welcome.redis_url or cfg.ledger.url:
        return welcome.redis_url or cfg.ledger.url
    raise TransportError(
        "the learner runs without transport.curve, so its Welcome carries no ledger credentials: set "
        "ledger.url on this node (RUN/config.toml has it), or turn transport.curve on on both sides"
    )
