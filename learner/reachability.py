"""Which of the run's nodes can no longer be reached: a killed node known within a beat, a frozen one never.

`Reachability` owns the marks of the nodes whose control connection was found closed (`unreachable_s`, which
the learner's overdue groups read) and when each node was last asked about. It asks in two cases: a node that
missed a heartbeat, and every node for a moment after the control socket's monitor saw a connection close (a
sweep). Asking is a `Probe` send (`ControlServer.connected`), which fails at once for a process the kernel closed
the sockets of (kill -9, out of memory) and never for a live one, however slow.

It keeps no roster: the nodes in the run are `NodeRegistry`'s (learner/nodes.py), which passes them to `check`
on each turn of its control thread and tells this module when a node registers, is heard, says goodbye or
leaves the run. Both run on the registry's control thread, which owns the socket; other threads only read the
marks (`unreachable_s`), under this object's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from streamrl.engine.control import HEARTBEAT_S, ControlServer

if TYPE_CHECKING:  # the registry imports this module: its NodeInfo is named for the type checker only
    from streamrl.learner.nodes import NodeInfo

log = logging.getLogger("streamrl.learner")

# A node beats every HEARTBEAT_S (rollout/control.py): one that missed a beat (silent a fifth of a beat past it) is
# asked whether its connection is open, so a killed node is known within a beat or so, not after the seconds of
# silence a frozen one is given.
PROBE_AFTER_S = 1.2 * HEARTBEAT_S
PROBE_EVERY_S = 0.4 * HEARTBEAT_S
SWEEP_S = 0.2  # after the socket saw a connection close, every node is asked this long (each pass of the thread)


class Reachability:
    """The nodes found unreachable and when each was last asked. `silent_s(node_id)`: seconds since the
    registry last heard the node (inf when not registered), which decides who missed a beat."""

    def __init__(self, server: ControlServer, silent_s: Callable[[str], float]):
        self.server, self.silent_s = server, silent_s
        self.unreachable: dict[str, float] = {}  # node -> when its connection was found closed (not heard since)
        self._probed: dict[str, float] = {}  # node -> when it was last asked about (monotonic; inf: it said goodbye)
        self._sweep_until = 0.0  # every node is asked until then (monotonic): a connection of the socket closed
        self.lock = threading.Lock()

    def check(self, nodes: dict[str, NodeInfo]) -> None:
        """Whether the nodes still have a connection: a node killed (kill -9, out of memory) is known at once,
        as the socket says a connection closed (then every node is asked, for SWEEP_S: the close reaches the
        socket's peers table a moment after its monitor), else within a beat (a node that missed one is asked).
        Only a failed send proves it, so a node alive but slow (frozen, its beats late) is never taken for
        gone; one whose connection dropped and came back is heard again, which clears it."""
        now = time.monotonic()
        if self.server.disconnected():
            self._sweep_until = now + SWEEP_S
        sweep = now < self._sweep_until
        for node_id, info in list(nodes.items()):
            if node_id in self.unreachable or not sweep and self.silent_s(node_id) < PROBE_AFTER_S:
                continue
            asked = self._probed.get(node_id, 0.0)
            if asked == float("inf") or not sweep and now - asked < PROBE_EVERY_S:
                continue
            self._probed[node_id] = now
            self.probe(node_id, info)

    def probe(self, node_id: str, info: NodeInfo | None) -> None:
        """Mark the node unreachable when the socket has no connection to it (also asked by the registry when a
        message to the node could not be delivered: known before the node is forgotten)."""
        if info is None or node_id in self.unreachable or self.server.connected(info.peer):
            return
        with self.lock:
            self.unreachable[node_id] = time.time()
        log.warning("node %s: its control connection closed (last heard %.1f s ago)", node_id, self.silent_s(node_id))

    def unreachable_s(self) -> dict[str, float]:
        """The nodes whose control connection was found closed and that were not heard from since: seconds since."""
        with self.lock:
            return {node_id: time.time() - found for node_id, found in self.unreachable.items()}

    def heard(self, node_id: str, peer: bytes) -> None:
        """A message from the node: it clears the mark only when its connection is open again (a message read
        after its connection closed was sent before: it proves nothing)."""
        if node_id in self.unreachable and self.server.connected(peer):
            with self.lock:
                self.unreachable.pop(node_id, None)

    def said_goodbye(self, node_id: str) -> None:
        """Its connection closes next, as it should: not a loss (a sweep may have seen it close); never asked again."""
        with self.lock:
            self._probed[node_id] = float("inf")
            self.unreachable.pop(node_id, None)

    def registered(self, node_id: str) -> None:
        """A new process under the id: what was found of an old one does not hold for it."""
        with self.lock:
            self.unreachable.pop(node_id, None)
            self._probed.pop(node_id, None)

    def left_run(self, node_id: str, resolved: bool) -> None:
        """The node is out of the run: no longer asked about. It stays unreachable unless `resolved`, as the
        registry's `forget` explains."""
        with self.lock:
            if resolved:
                self.unreachable.pop(node_id, None)
            self._probed.pop(node_id, None)
