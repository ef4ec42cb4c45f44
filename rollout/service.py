"""`streamrl rollout`: a rollout node that belongs to a run.

Start-up: the engine first (so the node can take weights the moment it registers), then
`Register` → `Welcome` from the learner (where the trajectory stream and the ledger are), then the
current weights when the run is past version 0, and only then generation. While it runs:
credits from the ledger bound how many groups are in flight, each trajectory is marked generated
before it is sent, heartbeats go to the ledger and the learner, and `WeightsReady` / `Stop` from
the learner are served by one control thread (ZMQ sockets are not thread-safe). On SIGTERM or
Ctrl-C the node stops taking credits, finishes or abandons its groups, resolves what it never
sent in the ledger (`preempted`) and says goodbye.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import queue
import signal
import socket
import threading
import time

from streamrl.engine.auth import client_keys
from streamrl.engine.config import Config, ConfigError
from streamrl.engine.control import ControlClient
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import (
    Goodbye,
    Heartbeat,
    Register,
    Stop,
    Trajectory,
    WeightsApplied,
    WeightsReady,
    Welcome,
)
from streamrl.engine.transport import TrajectorySender, TransportError

log = logging.getLogger("streamrl.rollout")

HEARTBEAT_S = 1.0


class LedgerCredits:
    """Admission through the ledger: one credit per group, returned when the group is resolved."""

    def __init__(self, ledger: Ledger, node_id: str, version_of=lambda: -1):
        """version_of: the policy version the node would generate with now (the ledger's admission
        weighs it against max_staleness, or, in sync mode, against the learner's newest)."""
        self.ledger, self.node_id, self.version_of = ledger, node_id, version_of

    async def acquire(self, group_id: str, sample_ids: list[str]) -> bool:
        n, version = len(sample_ids), self.version_of()
        taken = await asyncio.to_thread(self.ledger.take_credit, self.node_id, group_id, n, node_version=version)
        return taken is not None

    async def release(self, group_id: str, sample_ids: list[str], reason: str) -> None:
        why = "preempted" if reason == "abandoned" else "generation_error"
        await asyncio.to_thread(self.ledger.drop, sample_ids, why)

    async def drop(self, sample_ids: list[str], reason: str) -> None:
        """Samples of a group that goes on without them (a failed episode), resolved with their reason."""
        await asyncio.to_thread(self.ledger.drop, sample_ids, reason)


class LedgerSink:
    """Marks each trajectory generated in the ledger, then streams it to the learner."""

    def __init__(self, ledger: Ledger, sender: TrajectorySender):
        self.ledger, self.sender = ledger, sender

    def send(self, traj: Trajectory) -> int:
        if not self.ledger.mark_generated([traj])[0]:
            # Not ours any more (reaped as lost while generating, or resolved already): the learner
            # would refuse it, so it is not sent.
            log.warning("sample %s is no longer this node's in the ledger; not sent", traj.sample_id)
            return -1
        return self.sender.send(traj)


class ControlLoop(threading.Thread):
    """Heartbeats to the learner out; WeightsReady and Stop in. The control socket is this thread's.

    A `WeightsReady` starts the update on the node's event loop and the thread goes on serving (the
    engine keeps generating while the version is staged); the `WeightsApplied` is sent from here once
    the version is live. `first_weights` is set once a version went live (a node joining past version
    0 waits for it before generating)."""

    def __init__(self, client: ControlClient, node, loop: asyncio.AbstractEventLoop):
        super().__init__(name="control", daemon=True)
        self.client, self.node, self.loop = client, node, loop
        self.stopping = threading.Event()
        self.first_weights = threading.Event()
        self.stop_reason = ""
        self._applied: queue.Queue[WeightsApplied] = queue.Queue()

    def run(self) -> None:
        last_beat = 0.0
        while not self.stopping.is_set():
            if time.monotonic() - last_beat > HEARTBEAT_S:
                self._beat()
                last_beat = time.monotonic()
            self._confirm()
            msg = self.client.recv(0.02)
            if isinstance(msg, WeightsReady):
                self._apply(msg)
            elif isinstance(msg, Stop):
                self.stop_reason = msg.reason
                log.info("the learner asked this node to stop: %s", msg.reason)
                self.loop.call_soon_threadsafe(self.node.abandon, msg.reason)  # no learner to send to
                self.first_weights.set()  # nothing more will come; let a waiting start-up end
                return

    def _beat(self) -> None:
        clock = getattr(self.node.engine, "clock", None)
        generate_s, idle_s, swap_s = clock.snapshot() if clock is not None else (0.0, 0.0, 0.0)
        try:
            self.client.send(
                Heartbeat(
                    node_id=self.node.node_id,
                    policy_version=self.node.policy_version,
                    in_flight=len(self.node.in_flight),
                    tokens_generated=self.node.stats.tokens_sent,
                    generate_s=generate_s,
                    idle_s=idle_s,
                    swap_s=swap_s,
                ),
                timeout_s=1.0,
            )
        except TransportError as e:
            log.warning("heartbeat to the learner failed: %s", e)

    def _apply(self, ready: WeightsReady) -> None:
        future = asyncio.run_coroutine_threadsafe(self.node.apply_weights(ready), self.loop)
        future.add_done_callback(lambda done: self._applied.put(self._outcome(ready, done)))

    def _outcome(self, ready: WeightsReady, done) -> WeightsApplied:
        error, seconds = "", 0.0
        try:
            seconds = done.result()
        except Exception as e:  # noqa: BLE001 - reported to the learner, which evicts the node
            error = f"{type(e).__name__}: {e}"
            log.error("weights version %d failed: %s", ready.version, error)
        return WeightsApplied(node_id=self.node.node_id, version=ready.version, seconds=seconds, error=error)

    def _confirm(self) -> None:
        while True:
            try:
                applied = self._applied.get_nowait()
            except queue.Empty:
                return
            try:
                self.client.send(applied)
            except TransportError as e:  # the learner times the version out and evicts; keep serving
                log.warning("could not confirm weights version %d: %s", applied.version, e)
            if not applied.error:
                self.first_weights.set()


class LedgerHeartbeat(threading.Thread):
    """Keeps the node alive in the ledger, apart from the control thread (which may be busy applying
    weights for longer than a heartbeat period)."""

    def __init__(self, ledger: Ledger, node_id: str):
        super().__init__(name="ledger-heartbeat", daemon=True)
        self.ledger, self.node_id = ledger, node_id
        self.period_s = ledger.config.heartbeat_ttl_s / 4
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.period_s):
            try:
                self.ledger.heartbeat(self.node_id)
            except Exception as e:  # noqa: BLE001 - a missed beat is logged; the ledger's TTL judges
                log.warning("ledger heartbeat failed: %s", e)


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


def register(client: ControlClient, node_id: str, backend: str, device: str, timeout_s: float) -> Welcome:
    welcome = client.request(
        Register(node_id=node_id, host=socket.gethostname(), device=device, backend=backend),
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


class _Inputs:
    """What a node checks locally before it loads the model or contacts the learner."""

    def __init__(self, cfg: Config, node_id: str):
        from streamrl.engine.models import default_tiny_model, load_tokenizer
        from streamrl.rewards import build_scorer
        from streamrl.rollout.engine import check_sampling
        from streamrl.rollout.sources import PromptSource

        self.tokenizer = load_tokenizer(cfg.model.path or str(default_tiny_model()), cfg.model.trust_remote_code)
        seed = cfg.run.seed + sum(node_id.encode()) % 997  # nodes draw prompts in different orders
        self.source = PromptSource(cfg.data, self.tokenizer, seed=seed)
        check_sampling(cfg.rollout)
        self.scorer = build_scorer(cfg.reward, answer_column=cfg.data.answer_column)


async def serve(cfg: Config, learner_addr: str, node_id: str, max_groups: int | None = None) -> int:
    from streamrl.engine.redis_server import connect
    from streamrl.rollout.backends import build_engine, resolve_device
    from streamrl.rollout.node import RolloutNode

    inputs = _Inputs(cfg, node_id)
    try:
        check_reachable(learner_addr, cfg.transport.send_timeout_s)
        device = resolve_device(cfg.run.device)
        log.info("phase: loading the %s engine on %s", cfg.rollout.backend, device)  # `phase:` lines: the live view
        engine = build_engine(cfg, device)  # before registering: weights can be taken at once
        warm_s = await engine.warm_up()  # compile before serving, so nothing compiles mid-run
        if warm_s:
            log.info("engine warmed up in %.1f s", warm_s)
    except BaseException:
        inputs.scorer.close()
        raise
    t = cfg.transport
    keys = client_keys(cfg)  # CURVE: this node's key pair and the learner's public key (None without)
    client = ControlClient(learner_addr, node_id, t.recv_timeout_s, max_frame_mb=t.max_frame_mb,
                           fault_log_interval_s=t.fault_log_interval_s, keys=keys)  # fmt: skip
    try:
        log.info("phase: registering with the learner at %s", learner_addr)
        welcome = register(client, node_id, cfg.rollout.backend, device, cfg.transport.recv_timeout_s)
        log.info("phase: registered as %s at policy version %d", node_id, welcome.policy_version)
        ledger = Ledger(connect(welcome.redis_url, cfg.ledger.connect_retries), welcome.run_name, cfg.ledger)
        ledger.heartbeat(node_id)
        beat = LedgerHeartbeat(ledger, node_id)
        beat.start()
        try:
            with TrajectorySender(
                welcome.trajectory_addr,
                node_id,
                t.hwm,
                t.send_timeout_s,
                max_frame_mb=t.max_frame_mb,
                keys=keys,
                secret=welcome.secret,
            ) as tx:
                sink = LedgerSink(ledger, tx)
                credits = LedgerCredits(ledger, node_id, version_of=lambda: engine.policy_version)
                node = RolloutNode(
                    cfg, node_id, engine, inputs.source, inputs.scorer, sink, inputs.tokenizer, credits=credits
                )
                return await _generate(cfg, client, ledger, node, welcome, beat, max_groups)
        finally:
            beat.stopping.set()
    finally:
        await engine.close()
        inputs.scorer.close()
        client.close()


async def _generate(
    cfg: Config,
    client: ControlClient,
    ledger: Ledger,
    node,
    welcome: Welcome,
    beat: LedgerHeartbeat,
    max_groups: int | None = None,
) -> int:
    loop = asyncio.get_running_loop()
    control = ControlLoop(client, node, loop)
    signalled: list[str] = []

    def on_signal(name: str) -> None:  # also before generation starts (node.stop alone would be lost then)
        signalled.append(name)
        node.stop(name)
        control.first_weights.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, signal.Signals(sig).name)
    control.start()
    try:
        if welcome.policy_version > 0:  # joining mid-run: the current weights before any generation
            timeout_s = cfg.weights.timeout_s * 3
            if not await asyncio.to_thread(control.first_weights.wait, timeout_s):
                raise TransportError(
                    f"no weights (version {welcome.policy_version}) from the learner within {timeout_s:g} s of joining"
                )
        log.info("phase: generating")
        stats = node.stats if control.stop_reason or signalled else await node.run(max_groups)
    finally:
        control.stopping.set()
        await asyncio.to_thread(control.join, 5.0)
        beat.stopping.set()  # no beat after leaving, or the node would be reaped again later
        left = ledger.leave(node.node_id, "preempted")
        if not control.is_alive():  # the socket is the control thread's while it lives
            try:
                client.send(Goodbye(node_id=node.node_id, reason=control.stop_reason or "stopped"), timeout_s=1.0)
            except TransportError:
                pass  # the learner is gone already
    source = node.source
    log.info(
        "node %s done: %d groups sent, %d samples resolved on leaving; prompts skipped: %d overlong, %d malformed",
        node.node_id,
        stats.groups_sent,
        left,
        getattr(source, "skipped_overlong", 0),
        getattr(source, "skipped_malformed", 0),
    )
    return 0


def main(cfg: Config, learner: str = "", node_id: str | None = None, max_groups: int | None = None) -> int:
    """Run one registered rollout node; the process exit status: 0 done, 1 the learner unreachable or
    gone, 2 bad input (config, model, data, rewards)."""
    from streamrl.engine.models import ModelLoadError
    from streamrl.engine.telemetry import setup_logging
    from streamrl.rewards import RewardSpecError
    from streamrl.rollout.sources import PromptSourceError

    node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
    setup_logging(cfg.run.path, f"rollout-{node_id}", console=True, level=cfg.telemetry.log_level)
    try:
        return asyncio.run(serve(cfg, resolve_learner(learner, cfg), node_id, max_groups))
    except TransportError as e:
        log.error("%s", e)
        return 1
    except (ConfigError, ModelLoadError, PromptSourceError, RewardSpecError, ValueError) as e:
        log.error("bad input: %s", e)
        return 2
