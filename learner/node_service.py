"""nodes: what learner rank 0 does for the rollout nodes between receives.

Who is in the run is the `NodeRegistry`'s (learner/nodes.py); this module serves it: a node that
registers is told where to send and which weights path to take (`welcome`), and gets the current weights
before anything else (`serve`); the publisher reports the nodes that cannot take the weights and the
ledger those that stopped beating, and the registry moves each out. `RUN/learner.json` says where nodes
find this learner (`write_address_file`); at the end every node is told to stop and its last frames are
taken in until it says goodbye (`stop_all`).
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from collections.abc import Callable

from streamrl.engine.config import Config
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import Welcome
from streamrl.engine.redis_server import redact
from streamrl.engine.weights.paths import this_process
from streamrl.learner.intake import Intake
from streamrl.learner.nodes import NodeRegistry
from streamrl.learner.publisher import Publisher

log = logging.getLogger("streamrl.learner")

REAP_EVERY_S = 2.0


class NodeService:
    """Serves the registry's nodes: Welcomes, weights for new nodes, evictions and reaps, the stop.

    `redis_url` goes into a Welcome only when the node proved its key (`authenticated`: CURVE is on)."""

    def __init__(
        self,
        cfg: Config,
        registry: NodeRegistry,
        ledger: Ledger,
        intake: Intake,
        publisher: Publisher,
        version_of: Callable[[], int],
        redis_url: str,
        authenticated: bool,
    ):
        self.cfg, self.registry, self.ledger, self.intake, self.publisher = cfg, registry, ledger, intake, publisher
        self.version_of, self.redis_url, self.authenticated = version_of, redis_url, authenticated
        self._last_reap = 0.0

    def welcome(self, node_id: str) -> Welcome:
        """A registering node's answer: the current version is asked of its owner at this moment."""
        return Welcome(
            node_id=node_id,
            trajectory_addr=self.intake.addr,
            redis_url=self.redis_url if self.authenticated else "",  # the password only to an authenticated node
            run_name=self.cfg.run.name,
            policy_version=self.version_of(),
            weights_path=self.publisher.path_for(self.registry.location(node_id)),
        )

    def write_address_file(self, run_dir: pathlib.Path, incarnation: str) -> None:
        """`RUN/learner.json`: where nodes find this learner (`streamrl rollout --learner RUN_FOLDER`)."""
        path = run_dir / "learner.json"
        tmp = path.with_suffix(".tmp")
        addresses = {"control_addr": self.registry.addr, "trajectory_addr": self.intake.addr}
        # no credentials here: the file is readable by others, and nodes get the ledger's URL in their Welcome;
        # the process: `streamrl status` on this machine tells a killed learner from a live one at once
        record = {**addresses, "redis_url": redact(self.redis_url), "run": self.cfg.run.name}
        tmp.write_text(json.dumps({**record, "incarnation": incarnation, **this_process()}))
        tmp.rename(path)

    def serve(self) -> None:
        """Registrations, departures and lost nodes; a new node gets the current weights first. Who is in
        the run is the registry's: the publisher reports the nodes that cannot take the weights, the ledger
        those that stopped beating, and the registry moves each out."""
        for kind, node_id in self.registry.take_events():
            if kind == "joined":
                self.intake.forget_sender(node_id)  # a restarted node numbers its messages from 0
                self.registry.reset(node_id)
                self.publisher.add(node_id, self.registry.location(node_id))
                log.info("node %s joined (%d nodes)", node_id, self.registry.count)
            else:
                self.registry.leave(node_id)
        evicted: set[str] = set()
        for node_id, why in self.publisher.poll():  # a failed transfer, or a version never confirmed live
            self.registry.evict(node_id, why)
            evicted.add(node_id)  # out of the count now: the registry forgets it once its Stop is out
            left = sum(1 for other in list(self.registry.nodes) if other not in evicted)
            log.warning("node %s was evicted (%d nodes left)", node_id, left)
        if time.monotonic() - self._last_reap > REAP_EVERY_S:
            self._last_reap = time.monotonic()
            self._reap()

    def _reap(self) -> None:
        """Nodes whose ledger heartbeat expired: their in-flight samples resolved, the registry told."""
        ttl = self.cfg.ledger.heartbeat_ttl_s
        for node_id, samples in self.ledger.reap_lost_nodes().items():
            log.warning(
                "node %s stopped beating: %d in-flight samples resolved (%s)",
                node_id,
                samples,
                self.cfg.ledger.on_node_lost,
            )
            self.registry.lost(node_id, f"lost: no heartbeat in the ledger for {ttl:g} s (ledger.heartbeat_ttl_s)")

    def stop_all(self, reason: str, drain_s: float) -> None:
        """Tell every node to stop (`reason`) and keep taking (and discarding) what they still send until
        they said goodbye or `drain_s` passed, so no node blocks on a send to a learner that is gone."""
        self.publisher.tree.stopping = True  # nodes leaving now are not replaced in the relay tree
        self.registry.stop_all(reason)
        deadline = time.monotonic() + drain_s
        while self.registry.count and time.monotonic() < deadline:
            self.intake.drain(0.05)
            for kind, node_id in self.registry.take_events():
                if kind == "left":
                    self.registry.leave(node_id)
