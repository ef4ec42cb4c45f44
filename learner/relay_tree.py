"""Weights to many nodes of other hosts at once: the learner sends each version to a few, and nodes relay it on.

On a broadcast path (gloo, NCCL: a node off the learner's machine) each node with a `_Link`
(learner/publisher.py) costs the learner a thread, a TCPStore, a group and the weights' bytes once per version:
its work and the time to the last node grow with the nodes (gloo over loopback: 0.064 s to the last of 32 nodes,
5.9 s to the last of 128; docs/SCALE.md "The push at width"). Here the learner keeps links to the first
`weights.relay_fanout` such nodes only (the roots); every later node is a `Child` of a node that can relay (its
receiver runs in its own process: `Register.relays`), at most `relay_fanout` children a node, placed as shallow
as there is room. A parent forwards each version it receives to its children (engine/weights/relay.py); the
learner only hands each child its parent's `WeightsReady` (`forward`, a control message, no data), so its work
per version is `relay_fanout` transfers and a notice a node, and a version reaches N nodes in about
log_fanout(N) hops.

What a link gives a node, a child keeps, read by the publisher's `poll` and `states` as a link is: `state.sent`
is the version it was handed and when, so a child that never says a version is live is evicted one deadline
after (`weights.timeout_s`), as a linked node is; it skips to the newest version its parent has. What a parent
can break, the tree mends without evicting the child: a parent that leaves the run (evicted, lost, said goodbye)
has its children placed again at once (the first of them into its place when the learner has room for a link);
a child whose relayed version failed (its parent died mid-send) gets another parent, and is evicted only if the
next one fails too; a child whose parent has had a newer version live for a whole deadline without handing it
on gets another parent. The tree keeps no roster of its own beyond the parent of each node: a node leaves it
when the registry closes its link or child.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from streamrl.engine.messages import Relayed, RelayTo, WeightsApplied

if TYPE_CHECKING:
    from streamrl.learner.publisher import NodeWeights, Publisher

log = logging.getLogger("streamrl.learner")

LEARNER = ""  # the parent of a root: the learner itself (a `_Link`)


class Child:
    """A node whose versions a parent node relays: what the publisher reads of a link (`node_id`, `state`,
    `error`) and what the registry calls when the node leaves (`close`)."""

    def __init__(self, tree: RelayTree, node_id: str, state: NodeWeights):
        self.tree, self.node_id, self.state = tree, node_id, state
        self.error = None  # never set: a child's failures come in its WeightsApplied
        self.failed = False  # its last relayed version failed (the next failure evicts it)
        self.behind_since = 0.0  # when its parent was first seen live on a version it was not handed
        self.moved = False  # it became a root (a link of its own): closing this is not leaving

    def close(self) -> None:
        if not self.moved:
            self.tree.left(self.node_id)


class RelayTree:
    """Who relays to whom: a parent per node on a broadcast path (the learner for the roots)."""

    def __init__(self, publisher: Publisher, fanout: int):
        self.publisher, self.fanout = publisher, fanout
        self._lock = threading.RLock()
        self.parent: dict[str, str] = {}  # every node in the tree -> its parent (LEARNER for a root)
        self.children: dict[str, list[str]] = {}  # a node that can relay -> its children
        self.kids: dict[str, Child] = {}  # the relayed nodes
        self.stopping = False  # the run is ending: a node that leaves is not replaced (its children are leaving too)

    @property
    def roots(self) -> list[str]:
        return [n for n, p in self.parent.items() if p == LEARNER]

    def place(self, relays: bool) -> str:
        """The parent for a new node: the learner while it has fewer than `fanout` roots, else the shallowest node
        with room (the learner again when none has: nodes that cannot relay fill no tree)."""
        with self._lock:
            if len(self.roots) < self.fanout:
                return LEARNER
            return self._room() or LEARNER

    def _room(self, skip: str = "") -> str:
        """The shallowest node with fewer than `fanout` children (breadth first from the roots), not `skip`."""
        level = self.roots
        while level:
            for node in level:
                if node in self.children and node != skip and len(self.children[node]) < self.fanout:
                    return node
            level = [c for node in level for c in self.children.get(node, [])]
        return ""

    def add_root(self, node_id: str, relays: bool) -> None:
        with self._lock:
            self.parent[node_id] = LEARNER
            if relays:
                self.children.setdefault(node_id, [])

    def add_child(self, node_id: str, parent: str, state: NodeWeights, relays: bool) -> Child:
        """A `Child` of `parent` for the caller to attach to the node's entry in the registry."""
        child = Child(self, node_id, state)
        with self._lock:
            self.kids[node_id] = child
            if relays:
                self.children.setdefault(node_id, [])
            self._adopt(node_id, parent)
        return child

    def _adopt(self, node_id: str, parent: str) -> None:
        self.parent[node_id] = parent
        self.children[parent].append(node_id)
        self._tell(parent)

    def _tell(self, parent: str) -> None:
        """The parent's whole list of children, with the version each has live (it sends them only newer ones)."""
        kids = [self.kids[c] for c in self.children.get(parent, [])]
        msg = RelayTo(children=[k.node_id for k in kids], versions=[k.state.applied for k in kids])
        self.publisher.registry.send(parent, msg)

    def left(self, node_id: str) -> None:
        """The node is out of the run (the registry closed its link or child): out of the tree, its children placed
        again at once."""
        with self._lock:
            parent = self.parent.pop(node_id, None)
            self.kids.pop(node_id, None)
            orphans = self.children.pop(node_id, [])
            if parent and node_id in self.children.get(parent, []):
                self.children[parent].remove(node_id)
                self._tell(parent)
            for orphan in orphans:
                self.parent.pop(orphan, None)
                if self.stopping:
                    self.kids.pop(orphan, None)
                    continue
                self._place_again(orphan, f"its parent {node_id} left the run")

    def _place_again(self, node_id: str, why: str, skip: str = "") -> None:
        """Another parent for a child (its subtree comes with it): a node with room, else the learner (a link)."""
        child = self.kids[node_id]
        child.behind_since, child.state.sent = 0.0, child.state.applied  # nothing in flight: no deadline runs
        parent = LEARNER if len(self.roots) < self.fanout else self._room(skip=skip)
        if parent == LEARNER:
            log.info("node %s: weights from the learner now (%s)", node_id, why)
            child.moved = True
            self.kids.pop(node_id)
            self.parent[node_id] = LEARNER
            self.publisher.link(node_id, child.state)  # replaces the child on the node's entry
            return
        log.info("node %s: weights relayed by node %s now (%s)", node_id, parent, why)
        self._adopt(node_id, parent)

    def move(self, node_id: str, why: str) -> None:
        """A child its parent failed: to another parent (not the one it has)."""
        with self._lock:
            parent = self.parent.get(node_id)
            if node_id not in self.kids or parent is None:
                return
            self.children[parent].remove(node_id)
            self._tell(parent)
            self._place_again(node_id, why, skip=parent)

    def forward(self, msg: Relayed) -> None:
        """A parent's layout for its child (the registry's control thread calls this): handed on if the child is still
        that parent's, and the child is then 'sent' that version (its deadline runs from here)."""
        with self._lock:
            child = self.kids.get(msg.child)
            if child is None or self.parent.get(msg.child) != msg.node_id:
                return  # it moved meanwhile: the old parent's send times out on its own group
            child.state.sent, child.state.sent_at = msg.ready.version, time.monotonic()
            child.state.transfers += 1
        self.publisher.registry.send(msg.child, msg.ready)

    def applied(self, child: Child, applied: WeightsApplied) -> str:
        """A child's word on a version: why to evict it ('' to keep it). A failed relayed version moves it to
        another parent once; a second failure in a row is its own."""
        if not applied.error:
            child.failed = False
            return ""
        if child.failed:
            return f"version {applied.version} failed on the node twice, from two relays: {applied.error}"
        child.failed = True
        self.move(child.node_id, f"version {applied.version} failed: {applied.error}")
        return ""

    def check(self, states: dict[str, NodeWeights], now: float) -> None:
        """Children whose parent has had a newer version live for a deadline without handing it on: moved."""
        late = []
        with self._lock:
            for node_id, child in self.kids.items():
                parent = states.get(self.parent.get(node_id, LEARNER))
                idle = child.state.sent <= child.state.applied
                if parent is None or not idle or parent.applied <= child.state.sent:
                    child.behind_since = 0.0
                    continue
                child.behind_since = child.behind_since or now
                if now - child.behind_since > self.publisher.cfg.weights.timeout_s:
                    late.append(node_id)
        for node_id in late:
            self.move(node_id, "its parent did not relay its newest version within weights.timeout_s")
