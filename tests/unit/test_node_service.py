"""The nodes flow (learner/node_service.py) without a run: a node registers over the real control socket
(rollout/registration.py, the node's side) and is welcomed, is given its weights link when the service
serves, and is reaped from the run once its ledger heartbeat expires (real Redis, real ZMQ)."""

from __future__ import annotations

import json
import time

import torch

from streamrl.engine.config import build
from streamrl.engine.control import ControlClient, ControlServer
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import EventLog
from streamrl.engine.transport import TrajectoryReceiver
from streamrl.learner.intake import Intake
from streamrl.learner.node_service import REAP_EVERY_S, NodeService
from streamrl.learner.nodes import NodeRegistry
from streamrl.learner.publisher import Publisher
from streamrl.rollout.registration import register


def serve_until(service: NodeService, done, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        service.serve()
        time.sleep(0.05)
    return done()


def test_a_node_is_welcomed_linked_and_reaped_once_it_stops_beating(redis_url, ledger_run, tmp_path):
    ttl = 0.5
    cfg = build({}, [f"run.dir='{tmp_path}'", f"run.name='{ledger_run}'", f"ledger.heartbeat_ttl_s={ttl}"])
    ledger = Ledger(connect(redis_url), ledger_run, cfg.ledger)
    ledger.init_run(groups_per_step=1)
    events = EventLog(cfg.run.path, "learner")
    services: list[NodeService] = []  # the registry is built before the parts a Welcome names
    registry = NodeRegistry(ControlServer(), lambda node_id: services[0].welcome(node_id), events)
    intake = Intake(TrajectoryReceiver(), ledger, alarm=None)
    publisher = Publisher(cfg, registry, torch.device("cpu"))
    services.append(NodeService(cfg, registry, ledger, intake, publisher, lambda: 3, redis_url, authenticated=False))
    service = services[0]
    registry.start()
    client = ControlClient(registry.addr, "n1", 5.0)
    try:
        welcome = register(client, "n1", "hf", "cpu", timeout_s=5.0)
        # where to send and which version is live; no ledger credentials to a node that proved no key
        assert (welcome.trajectory_addr, welcome.policy_version, welcome.redis_url) == (intake.addr, 3, "")
        ledger.heartbeat("n1")
        assert serve_until(service, lambda: "n1" in registry.links(), 5.0)  # joined: its weights link made
        assert registry.count == 1
        # silent from now on: the ledger's TTL passes and the next reap (every REAP_EVERY_S) takes it out
        started = time.monotonic()
        assert serve_until(service, lambda: registry.count == 0, ttl + REAP_EVERY_S + 5.0)
        assert time.monotonic() - started > ttl and "n1" not in registry.links()
        kinds = [json.loads(line)["event"] for line in events.path.read_text().splitlines()]
        assert kinds.count("node_joined") == 1 and "node_lost" in kinds
    finally:
        client.close()
        registry.close()
        intake.close()
