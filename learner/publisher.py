"""Weights out: each new policy version pushed to every registered rollout node.

The publisher keeps the latest version it was given, so a node that joins mid-run gets the current
weights before it generates. A node whose transfer fails or times out is evicted: told `Stop` and
forgotten by the registry; the other nodes carry on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import Tensor

from streamrl.engine.config import Config
from streamrl.engine.messages import Stop, WeightsReady
from streamrl.engine.weights import TransferResult, WeightBroadcaster
from streamrl.learner.nodes import NodeRegistry

log = logging.getLogger("streamrl.learner")


class Publisher:
    def __init__(self, cfg: Config, registry: NodeRegistry, device: torch.device):
        self.cfg, self.registry = cfg, registry
        self.broadcaster = WeightBroadcaster(cfg.weights, device=device)
        self.latest: tuple[int, Mapping[str, Tensor]] | None = None

    @property
    def nodes(self) -> list[str]:
        return self.broadcaster.nodes

    def add(self, node_id: str) -> None:
        """A node joined (or re-joined: it gets a fresh weight group); it gets the latest weights first."""
        if node_id in self.broadcaster.senders:
            self.broadcaster.remove_node(node_id)
        self.broadcaster.add_node(node_id)
        if self.latest is not None and self.latest[0] > 0:
            self.push(*self.latest, nodes=[node_id])

    def remove(self, node_id: str) -> None:
        self.broadcaster.remove_node(node_id)

    def push(
        self, version: int, state: Mapping[str, Tensor], nodes: list[str] | None = None
    ) -> dict[str, TransferResult]:
        """Push `state` as `version` to the nodes (all by default); failed nodes are evicted and told."""
        self.latest = (version, state)
        if not self.broadcaster.nodes:
            return {}
        results = self.broadcaster.broadcast(state, version, self._send_layout, self.registry.wait_applied, nodes=nodes)
        for node_id, result in results.items():
            if not result.ok:
                self._evict(node_id, str(result.error))
        return results

    def _evict(self, node_id: str, why: str) -> None:
        log.error("evicted node %s: %s", node_id, why)
        told = self.registry.send(node_id, Stop(reason=f"evicted: {why}"))
        try:  # forget the node only once the Stop left (or could not), or it is never sent
            told.result(timeout=self.cfg.transport.send_timeout_s + 5.0)
        except Exception:  # noqa: BLE001 - gone already: nothing more to tell it
            pass
        self.registry.forget(node_id)

    def _send_layout(self, node_id: str, ready: WeightsReady) -> None:
        """Deliver the layout or raise at once: a node that is gone fails its transfer now, not at the
        rendezvous deadline."""
        self.registry.send(node_id, ready).result(timeout=self.cfg.transport.send_timeout_s + 5.0)

    def close(self) -> None:
        for node_id in self.broadcaster.nodes:
            self.broadcaster.remove_node(node_id)
