"""`streamrl rollout`: a rollout node that belongs to a run.

Start-up: the engine first (so the node can take weights the moment it registers), then
`Register` → `Welcome` from the learner (where the trajectory stream and the ledger are), then the
current weights when the run is past version 0, and only then generation. While it runs:
credits from the ledger bound how many groups are in flight, each trajectory is marked generated
before it is sent, heartbeats go to the ledger and the learner, and `WeightsReady` / `Stop` from
the learner are served by one control thread (ZMQ sockets are not thread-safe). On SIGTERM or
Ctrl-C the node stops taking credits, finishes or abandons its groups, resolves what it never
sent in the ledger (`preempted`) and says goodbye, within `stop_bound_s(cfg)`: past it the node
exits anyway, and whoever stopped it resolves what it still held (the launcher does).

A node outlives its learner: a learner restarted for the run announces itself in the ledger under
a new incarnation; the node sees it there (`LedgerHeartbeat`), abandons the groups it generated for
the old one (resolved as `preempted`), registers with the new one and takes its weights, keeping
its engine. A learner that does not come back ends the node when a send has waited
`transport.send_timeout_s`.

Finding and joining the learner is rollout/registration.py's; the credits and the marking sink are the
node's side of the ledger (rollout/ledger_link.py); the node loop is rollout/node.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading

from streamrl.engine.auth import client_keys
from streamrl.engine.config import Config, ConfigError
from streamrl.engine.control import ControlClient
from streamrl.engine.ledger import Ledger, LedgerUnavailableError
from streamrl.engine.messages import Goodbye, Welcome
from streamrl.engine.telemetry import EventLog
from streamrl.engine.transport import TrajectorySender, TransportError
from streamrl.rollout.control import ControlLoop, LedgerHeartbeat, can_relay
from streamrl.rollout.learner_gone import learner_gone
from streamrl.rollout.ledger_link import LedgerCredits, LedgerSink
from streamrl.rollout.registration import check_reachable, ledger_url, register, resolve_learner

log = logging.getLogger("streamrl.rollout")

STOP_GRACE_S = 30.0  # a stopping node finishes its groups in flight this long, then abandons the rest
SEND_SLICE_S = 1.0  # a blocked send waits in slices this long, so a stop or a learner's restart ends it
CLOSE_S = 20.0  # after the groups: the control thread's join (5 s), the goodbye (1 s), the engine's shutdown


def stop_bound_s(cfg: Config) -> float:
    """The longest a node takes from SIGTERM to its exit: the grace for its groups in flight, a blocked
    send's last slice, resolving the abandoned groups and leaving the ledger (each may retry for
    `ledger.retry_s` while Redis is away), closing. A node still running then exits at once."""
    return STOP_GRACE_S + SEND_SLICE_S + 2 * cfg.ledger.retry_s + CLOSE_S


class _Inputs:
    """What a node checks locally before it loads the model or contacts the learner."""

    def __init__(self, cfg: Config, node_id: str):
        from streamrl.engine.models import default_tiny_model, load_tokenizer
        from streamrl.rewards import build_scorer
        from streamrl.rollout.sources import PromptSource

        self.tokenizer = load_tokenizer(cfg.model.path or str(default_tiny_model()), cfg.model.trust_remote_code)
        seed = cfg.run.seed + sum(node_id.encode()) % 997  # nodes draw prompts in different orders
        self.source = PromptSource(cfg.data, self.tokenizer, seed=seed)
        self.scorer = build_scorer(cfg.reward, answer_column=cfg.data.answer_column)


class _StopSignal:
    """SIGTERM / Ctrl-C, for whichever learner's session runs: no new group, the groups in flight get
    `STOP_GRACE_S`, then a blocked send is cancelled; at `stop_bound_s(cfg)` the process exits whatever
    still blocks it (its samples are resolved by whoever stopped it, or by the learner's reaper)."""

    def __init__(self, cfg: Config, node_id: str):
        self.cfg, self.node_id = cfg, node_id
        self.name = ""
        self.node = self.control = self.sink = None

    def attach(self, node, control: ControlLoop, sink: LedgerSink) -> None:
        self.node, self.control, self.sink = node, control, sink

    def __call__(self, name: str) -> None:  # also before generation starts (node.stop alone would be lost then)
        first = not self.name
        self.name = name
        if self.node is not None:
            self.node.stop(name)
            self.control.first_weights.set()
        if first:
            _later(0.0, self._abandon_if_learner_gone)
            _later(STOP_GRACE_S, lambda: self.sink is not None and self.sink.cancel())
            _later(stop_bound_s(self.cfg), self._exit)

    def _abandon_if_learner_gone(self) -> None:
        """No grace for groups whose learner is gone (rollout/learner_gone.py): abandoned now, and resolved."""
        control = self.control
        gone = learner_gone(control.watch.ledger, control.watch.incarnation, self.cfg.run.path) if control else ""
        if gone:
            log.warning("node %s stops without the grace: the learner it serves is gone (%s)", self.node_id, gone)
            control.loop.call_soon_threadsafe(self.node.abandon, f"the learner is gone: {gone}")
            self.sink.cancel()

    def _exit(self) -> None:
        log.error(
            "node %s did not stop within %.0f s of %s (stop_bound_s: grace %g s + 2 x ledger.retry_s + %g s): "
            "exiting now",
            self.node_id,
            stop_bound_s(self.cfg),
            self.name,
            STOP_GRACE_S,
            CLOSE_S,
        )
        logging.shutdown()
        os._exit(1)


def _later(seconds: float, fn) -> None:
    timer = threading.Timer(seconds, fn)
    timer.daemon = True
    timer.start()


async def serve(cfg: Config, learner_addr: str, node_id: str, max_groups: int | None = None) -> int:
    """Build the engine once, then serve the run's learner, and the next one when it is restarted."""
    from streamrl.rollout.backends import build_backend, resolve_device

    inputs = _Inputs(cfg, node_id)
    try:
        check_reachable(learner_addr, cfg.transport.send_timeout_s)
        device = resolve_device(cfg.run.device)
        EventLog(cfg.run.path, node_id).emit("phase", phase="loading")  # phase events: the live view
        log.info("phase: loading the %s engine on %s", cfg.rollout.backend, device)
        engine = build_backend(cfg, device)  # before registering: weights can be taken at once
        warm_s = await engine.warm_up()  # compile before serving, so nothing compiles mid-run
        if warm_s:
            log.info("engine warmed up in %.1f s", warm_s)
    except BaseException:
        inputs.scorer.close()
        raise
    signalled = _StopSignal(cfg, node_id)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled, signal.Signals(sig).name)
    prompts = iter(inputs.source)  # one prompt stream across the learners this node serves
    try:
        while learner_addr and not signalled.name:
            learner_addr = await _session(cfg, learner_addr, node_id, engine, device, inputs, prompts, signalled,
                                          max_groups)  # fmt: skip
            if learner_addr:
                check_reachable(learner_addr, cfg.transport.send_timeout_s)
    finally:
        await engine.close()
        inputs.scorer.close()
    source = inputs.source
    log.info(
        "node %s done; prompts skipped: %d overlong, %d malformed",
        node_id,
        getattr(source, "skipped_overlong", 0),
        getattr(source, "skipped_malformed", 0),
    )
    return 0


async def _session(
    cfg: Config, learner_addr: str, node_id: str, engine, device: str, inputs: _Inputs, prompts, signalled: _StopSignal,
    max_groups: int | None,
) -> str:  # fmt: skip
    """One learner's service: register, take its weights, generate until stopped. The next learner's
    control address when another learner took the run over meanwhile, else ''."""
    from streamrl.engine.redis_server import connect
    from streamrl.rollout.evaluation import evaluating
    from streamrl.rollout.node import RolloutNode, sleeps_on

    t = cfg.transport
    keys = client_keys(cfg)  # CURVE: this node's key pair and the learner's public key (None without)
    client = ControlClient(learner_addr, node_id, t.recv_timeout_s, max_frame_mb=t.max_frame_mb,
                           fault_log_interval_s=t.fault_log_interval_s, keys=keys)  # fmt: skip
    events = EventLog(cfg.run.path, node_id)
    try:
        events.emit("phase", phase="registering")
        log.info("phase: registering with the learner at %s", learner_addr)
        welcome = register(client, node_id, cfg.rollout.backend, device, cfg.transport.recv_timeout_s,
                           can_relay(engine))  # fmt: skip
        events.emit("phase", phase="registered")
        log.info("phase: registered as %s at policy version %d", node_id, welcome.policy_version)
        ledger = Ledger(connect(ledger_url(cfg, welcome), cfg.ledger.connect_retries), welcome.run_name, cfg.ledger)
        ledger.heartbeat(node_id)
        beat = LedgerHeartbeat(ledger, node_id, ledger.learner().get("incarnation", ""))
        beat.start()
        try:
            with TrajectorySender(
                welcome.trajectory_addr,
                node_id,
                t.hwm,
                SEND_SLICE_S,
                max_frame_mb=t.max_frame_mb,
                keys=keys,
                secret=welcome.secret,  # this learner's secret for this node: a new one per registration
            ) as tx:
                sink = LedgerSink(ledger, tx, t.send_timeout_s)
                credits = LedgerCredits(ledger, node_id, version_of=lambda: engine.policy_version)
                scorer, tokenizer = inputs.scorer, inputs.tokenizer
                node = RolloutNode(cfg, node_id, engine, prompts, scorer, sink, tokenizer, credits, events, device)
                node.sleeps = sleeps_on(cfg, welcome.weights_path, engine)
                control = ControlLoop(client, node, asyncio.get_running_loop(), beat, sink)
                signalled.attach(node, control, sink)
                async with evaluating(cfg, node_id, engine, tokenizer, ledger):  # [eval]: rollout/evaluation.py
                    await _generate(cfg, client, ledger, node, welcome, control, signalled, max_groups)
                return control.moved_to
        finally:
            beat.stopping.set()
    finally:
        client.close()


async def _generate(
    cfg: Config,
    client: ControlClient,
    ledger: Ledger,
    node,
    welcome: Welcome,
    control: ControlLoop,
    signalled: _StopSignal,
    max_groups: int | None = None,
) -> None:
    control.start()
    ledger_lost = False
    try:
        if welcome.policy_version > 0:  # joining mid-run: the current weights before any generation
            timeout_s = cfg.weights.timeout_s * 3
            if not await asyncio.to_thread(control.first_weights.wait, timeout_s):
                raise TransportError(
                    f"no weights (version {welcome.policy_version}) from the learner within {timeout_s:g} s of joining"
                )
        if node.events is not None:
            node.events.emit("phase", phase="generating")
        log.info("phase: generating")
        stats = node.stats if control.stop_reason or signalled.name else await node.run(max_groups, STOP_GRACE_S)
    except LedgerUnavailableError:
        ledger_lost = True  # leaving would wait `ledger.retry_s` again; the reaper or the launcher resolves
        raise
    finally:
        control.stopping.set()
        control.sink.cancel()
        await asyncio.to_thread(control.join, 5.0)
        control.watch.stopping.set()  # no beat after leaving, or the node would be reaped again later
        left = 0 if ledger_lost else ledger.leave(node.node_id, "preempted")
        if not control.is_alive() and not control.moved_to:  # the socket is the control thread's while it lives
            try:
                client.send(Goodbye(node_id=node.node_id, reason=control.stop_reason or "stopped"), timeout_s=1.0)
            except TransportError:
                pass  # the learner is gone already
    log.info(
        "node %s done with the learner at %s: %d groups sent, %d samples resolved on leaving, asleep %d times",
        node.node_id,
        client.addr,
        stats.groups_sent,
        left,
        stats.sleeps,
    )


def main(cfg: Config, learner: str = "", node_id: str | None = None, max_groups: int | None = None) -> int:
    """Run one registered rollout node; the process exit status: 0 done, 1 the learner unreachable or
    gone (or the ledger's Redis past `ledger.retry_s`), 2 bad input (config, model, data, rewards)."""
    from streamrl.engine.models import ModelLoadError
    from streamrl.engine.telemetry import setup_logging
    from streamrl.rewards import RewardSpecError
    from streamrl.rollout.sources import PromptSourceError

    node_id = node_id or f"{socket.gethostname()}-{os.getpid()}"
    setup_logging(cfg.run.path, f"rollout-{node_id}", console=True, level=cfg.telemetry.log_level)
    try:
        return asyncio.run(serve(cfg, resolve_learner(learner, cfg), node_id, max_groups))
    except (TransportError, LedgerUnavailableError) as e:
        log.error("%s", e)
        return 1
    except (ConfigError, ModelLoadError, PromptSourceError, RewardSpecError, ValueError) as e:
        log.error("bad input: %s", e)
        return 2
