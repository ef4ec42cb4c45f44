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
is the version it was handed and when, so a child that never says a version is live is evicted (its transfer's
deadline and its swap's: 2 x `weights.timeout_s` from the hand-over); it skips to the newest version its parent
has. What a parent can break, the tree mends without evicting the child: a parent that leaves the run (evicted,
lost, said goodbye) has its children placed again at once (into its place among the roots when the learner has
room for a link); a child whose relayed version failed (its parent died mid-send) gets another parent, and is
evicted only if the next one fails too; a child whose parent has had a newer version live for a whole deadline
without handing it on gets another parent.

The tree keeps no roster: its shape hangs on the registry's links (each `_Link` or `Child` of a node in the tree
has a `parent`: `LEARNER` for a root, else the parent's node id; `None` off the tree), and each look asks the
registry, so a node that left is out of the tree with its link.
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

    def __init__(self, tree: RelayTree, node_id: str, state: NodeWeights, parent: str, relays: bool):
        self.tree, self.node_id, self.state = tree, node_id, state
        self.parent: str | None = parent
        self.relays = relays  # it can take children of its own
        self.error = None  # never set: a child's failures come in its WeightsApplied
        self.failed = False  # its last relayed version failed (the next failure evicts it)
        self.behind_since = 0.0  # when its parent was first seen live on a version it was not handed
        self.moved = False  # it became a root (a link of its own): closing this is not leaving

    def close(self) -> None:
        if not self.moved:
            self.tree.left(self.node_id, self.parent)


class RelayTree:
    """Who relays to whom, read off the registry's links: placement, hand-over and repair."""

    def __init__(self, publisher: Publisher, fanout: int):
        self.publisher, self.fanout = publisher, fanout
        self._lock = threading.RLock()
        self.stopping = False  # the run is ending: a node that leaves is not replaced (its children are leaving too)

    def _places(self) -> dict:
        """The links of the nodes in the tree now (the registry's: a node that left is not there)."""
        links = self.publisher.registry.links().items()
        return {n: link for n, link in links if getattr(link, "parent", None) is not None}

    @staticmethod
    def _children(places: dict, parent: str) -> list[str]:
        return [n for n, link in places.items() if link.parent == parent]

    @staticmethod
    def _by_parent(places: dict) -> dict[str, list[str]]:
        """Each parent's children in one pass (a placement at 1,000 nodes must not count children per node)."""
        kids: dict[str, list[str]] = {}
        for n, link in places.items():
            kids.setdefault(link.parent, []).append(n)
        return kids

    def place(self) -> str:
        """The parent for a new node: the learner while it has fewer than `fanout` roots, else the shallowest node
        with room (the learner again when none has: nodes that cannot relay fill no tree)."""
        with self._lock:
            return self._parent_for(self._places())

    def _parent_for(self, places: dict, skip: str = "") -> str:
        """The learner if it has room, else the shallowest node with fewer than `fanout` children (breadth first
        from the roots), not `skip`; the learner when none has."""
        kids = self._by_parent(places)
        level = kids.get(LEARNER, [])
        if len(level) < self.fanout:
            return LEARNER
        while level:
            for node in level:
                if places[node].relays and node != skip and len(kids.get(node, [])) < self.fanout:
                    return node
            level = [c for node in level for c in kids.get(node, [])]
        return LEARNER

    def add_child(self, node_id: str, parent: str, state: NodeWeights, relays: bool) -> Child:
        """A `Child` of `parent`, attached to the node's entry in the registry (which closes what it had)."""
        child = Child(self, node_id, state, parent, relays)
        with self._lock:
            self.publisher.registry.attach(node_id, child)
            self.tell(parent)
            if relays:
                self.tell(node_id)  # none yet: it keeps a copy of each version from now on
        return child

    def tell(self, parent: str) -> None:
        """The parent's whole list of children, with the version each has live (it sends them only newer ones).
        An empty list to a node that can relay says it is in the tree: it keeps a copy of each version."""
        kids = [link for link in self._places().values() if link.parent == parent]
        msg = RelayTo(children=[k.node_id for k in kids], versions=[k.state.applied for k in kids])
        self.publisher.registry.send(parent, msg)

    def left(self, node_id: str, parent: str | None = LEARNER) -> None:
        """The node is out of the run (the registry closed its link or child, after taking it off the node's entry):
        its parent (`parent`) stops serving it, and its children are placed again at once."""
        if self.stopping:
            return
        with self._lock:
            places = self._places()
            if parent and parent in places:
                self.tell(parent)
            for orphan in self._children(places, node_id):
                places[orphan].parent = None  # off the tree while it is placed again
                self._place_again(places[orphan], f"its parent {node_id} left the run")

    def _place_again(self, child: Child, why: str, skip: str = "") -> None:
        """Another parent for a child (its subtree comes with it): a node with room, else the learner (a link)."""
        child.behind_since, child.state.sent = 0.0, child.state.applied  # nothing in flight: no deadline runs
        parent = self._parent_for(self._places(), skip=skip)
        if parent == LEARNER:
            log.info("node %s: weights from the learner now (%s)", child.node_id, why)
            child.moved = True
            self.publisher.link(child.node_id, child.state, child.relays)  # replaces the child on the node's entry
            return
        log.info("node %s: weights relayed by node %s now (%s)", child.node_id, parent, why)
        child.parent = parent
        self.tell(parent)

    def move(self, child: Child, why: str) -> None:
        """A child its parent failed: to another parent (not the one it has)."""
        with self._lock:
            parent = child.parent
            if parent is None or child.moved:
                return
            child.parent = None
            self.tell(parent)
            self._place_again(child, why, skip=parent)

    def forward(self, msg: Relayed) -> None:
        """A parent's layout for its child (the registry's control thread calls this): handed on if the child is still
        that parent's, and the child is then 'sent' that version (its deadline runs from here)."""
        with self._lock:
            child = self.publisher.registry.link(msg.child)
            if not isinstance(child, Child) or child.parent != msg.node_id:
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
        self.move(child, f"version {applied.version} failed: {applied.error}")
        return ""

    def check(self, now: float) -> None:
        """Children whose parent has had a newer version live for a deadline without handing it on: moved."""
        late = []
        with self._lock:
            places = self._places()
            for child in places.values():
                parent = places.get(child.parent) if isinstance(child, Child) else None
                idle = isinstance(child, Child) and child.state.sent <= child.state.applied
                if parent is None or not idle or parent.state.applied <= child.state.sent:
                    if isinstance(child, Child):
                        child.behind_since = 0.0
                    continue
                child.behind_since = child.behind_since or now
                if now - child.behind_since > self.publisher.cfg.weights.timeout_s:
                    late.append(child)
        for child in late:
            self.move(child, "its parent did not relay its newest version within weights.timeout_s")
