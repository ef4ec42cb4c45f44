"""Weights out, never waiting on a node: each new policy version goes to every node in the background.

`publish(version, weights)` is the learner's only blocking part: it packs the weights (on the GPU,
in the dtype the engines serve) into flat buckets of a staging set and returns. One thread per node
(`_Link`) then pushes the newest published version to its node: layout over the control channel,
the node posts its receives, the broadcast. A node that falls behind skips to the newest version;
one whose transfer fails, or that does not confirm a version live within one deadline
(`weights.timeout_s`) after its transfer, is reported by `poll`; the orchestrator has the registry
(the roster's one owner) evict it. The learner trains on. The publisher keeps no list of nodes: each
link hangs on its node's entry in the registry (`NodeRegistry.attach`), which closes it when the node
leaves the run, however it leaves; `poll` and `states` read the links the registry hands them.
Each node's path is picked when it joins, from where it runs (engine/weights/paths.py): a broadcast
(NCCL, gloo), or, on the learner's own machine or GPU, the node's copy from the shared buffers. Nodes on
a shared path past `weights.fetch_after` get no link of their own: one thread serves them all
(learner/shared_fetch.py `SharedFetch`, one `Member` a node, read by `poll` and `states` as a link is). Nodes on
a broadcast path past `weights.relay_fanout` get theirs from another node (learner/relay_tree.py `RelayTree`, one
`Child` a node, read the same way): the learner links to `relay_fanout` of them only.

A staging set stays allocated while a transfer reads it or while it is the newest; a set no link
holds is reused by the next `publish`, so the learner keeps at most one set per version in flight. On
the shared paths a transfer lasts until the node confirmed its copy: the learner never repacks a set a
node is still reading (it packs the next version into another set meanwhile).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping

import torch
from torch import Tensor

from streamrl.engine.config import Config
from streamrl.engine.messages import AdapterSpec, WeightsReady
from streamrl.engine.weights import Location, WeightTransferError, choose, here, new_sender, resolve_backend
from streamrl.engine.weights.layout import PackedBuckets, plan_buckets
from streamrl.engine.weights.newest import Newest
from streamrl.engine.weights.paths import COLLECTIVE, SHARED
from streamrl.engine.weights.push import pack, push
from streamrl.engine.weights.staging import Sender
from streamrl.learner.nodes import NodeRegistry
from streamrl.learner.relay_tree import LEARNER, Child, RelayTree
from streamrl.learner.shared_fetch import Member, SharedFetch

log = logging.getLogger("streamrl.learner")


@dataclasses.dataclass
class _Set:
    """One published version's packed buckets."""

    version: int
    packed: PackedBuckets  # its pool: reused by a later version once no link reads this one
    event: torch.cuda.Event | None
    readers: int = 0


class _DeviceTimer:
    """CUDA events around one packing; `stop` returns the end event the transfers wait on."""

    def __init__(self, device: torch.device):
        self._events = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> torch.cuda.Event | None:
        if self._events is None:
            return None
        self._events[1].record()
        return self._events[1]

    def done(self) -> bool:
        return self._events is None or self._events[1].query()

    def seconds(self) -> float:
        return 0.0 if self._events is None else self._events[0].elapsed_time(self._events[1]) / 1000


@dataclasses.dataclass
class NodeWeights:
    """What the learner knows of one node's weights (for metrics and eviction)."""

    sent: int = 0  # newest version whose transfer finished
    sent_at: float = 0.0  # time.monotonic() of that
    applied: int = 0  # newest version the node confirmed live
    transfers: int = 0
    last_transfer_s: float = 0.0
    last_swap_s: float = 0.0  # the node's receive + swap, as it reported
    path: str = ""  # how its weights go: nccl, gloo, cuda_ipc, shm


class _Link(threading.Thread):
    """One node's sender thread: pushes the newest published version whenever the node is behind."""

    def __init__(self, publisher: Publisher, node_id: str, sender: Sender, state: NodeWeights | None = None):
        super().__init__(name=f"weights-{node_id}", daemon=True)
        self.publisher, self.node_id, self.sender = publisher, node_id, sender
        self.state = state or NodeWeights(path=sender.path)
        self.parent: str | None = None  # in the relay tree: LEARNER (a root); None: not in it
        self.relays = False  # a root that takes children (learner/relay_tree.py)
        self.error: WeightTransferError | None = None
        self.stopping = threading.Event()

    def close(self) -> None:
        """The node left the run (the registry calls this): the thread ends after its current transfer."""
        self.stopping.set()
        self.sender.close()
        if self.parent is not None:  # a root of the relay tree: its children get another parent
            self.publisher.tree.left(self.node_id)

    def run(self) -> None:
        while not self.stopping.is_set():
            published = self.publisher.take_newer(self.state.sent, timeout_s=0.2)
            if published is None:
                continue
            try:
                self._transfer(published)
            except WeightTransferError as e:
                self.error = e
                return
            finally:
                self.publisher.give_back(published)

    def _transfer(self, published: _Set) -> None:
        def deliver(ready: WeightsReady) -> None:  # over the node's control channel, waiting until it is out
            self.publisher.registry.send(self.node_id, ready).result(timeout=self.sender.timeout_s)

        seconds = push(self.sender, published.version, published.packed, deliver, adapter=self.publisher.adapter,
                       packed_event=published.event)  # fmt: skip
        self.state.sent, self.state.sent_at = published.version, time.monotonic()
        self.state.transfers += 1
        self.state.last_transfer_s = seconds


class Publisher:
    def __init__(self, cfg: Config, registry: NodeRegistry, device: torch.device, adapter: AdapterSpec | None = None):
        """adapter: LoRA's spec; each published version is then that adapter's tensors alone."""
        self.cfg, self.registry, self.device, self.adapter = cfg, registry, device, adapter
        self.backend = resolve_backend(cfg.weights.backend, device)  # where the buffers are: nccl → the GPU
        self.here = here(str(device))
        self._sets: Newest[_Set] = Newest()  # the packed versions the transfers read (engine/weights/newest.py)
        self._plans: dict[tuple, list] = {}
        self.hold_s = 0.0  # the last publish's hold on the caller
        self._timers: list[_DeviceTimer] = []  # the packings whose device time is not read yet
        self._pack_device_s = 0.0
        self._fetches: dict[str, SharedFetch] = {}  # shared path -> the thread serving its nodes past fetch_after
        self.tree = RelayTree(self, cfg.weights.relay_fanout)  # nodes on a broadcast path past relay_fanout
        registry.on_relayed(self.tree.forward)

    @property
    def latest_version(self) -> int:
        return self._sets.latest.version if self._sets.latest is not None else 0

    # ---- the learner's side: publish ---------------------------------------------------------

    def publish(self, version: int, weights: Mapping[str, Tensor]) -> float:
        """Pack `weights` as `version` for every node (they get it in the background); the seconds the
        caller was held (host time: the packing is queued on the device and read by the transfers)."""
        start = time.perf_counter()
        specs, fresh = self._plan(weights)
        free = self._sets.reuse()  # this thread alone writes sets: it stays free while packed into
        timer = _DeviceTimer(self._buffer_device)
        packed = pack(specs, weights, self._buffer_device, free.packed.pool if free is not None else None, check=fresh)
        fresh = _Set(version, packed, timer.stop())
        self._timers = [*self._timers[-7:], timer]  # read by the next reports; a few at most
        self._sets.post(fresh)
        self.hold_s = time.perf_counter() - start
        return self.hold_s

    def pack_device_s(self) -> float:
        """The device's time packing the newest version whose packing finished (0 on CPU: the packing
        is the hold itself there); never waits for the device."""
        while self._timers and self._timers[0].done():
            self._pack_device_s = self._timers.pop(0).seconds()
        return self._pack_device_s

    def _plan(self, weights: Mapping[str, Tensor]) -> tuple[list, bool]:
        """The bucket layout and whether it is new. Planned once for the tensors the learner hands over
        every step (the same objects: FSDP keeps its gathered parameters), so a step pays no per-tensor
        host work but the copy; other tensors get a plan, checked when packed."""
        key = (tuple(weights), tuple(map(id, weights.values())), tuple(t.shape for t in weights.values()))
        if key in self._plans:
            return self._plans[key], False
        self._plans = {key: plan_buckets(weights, int(self.cfg.weights.bucket_mb * 2**20))}
        return self._plans[key], True

    @property
    def _buffer_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def take_newer(self, than: int, timeout_s: float) -> _Set | None:
        """The newest set if it is newer than `than` (held until `give_back`), else None after `timeout_s`."""
        return self._sets.take_newer(than, timeout_s)

    def give_back(self, published: _Set) -> None:
        self._sets.give_back(published)

    def wake(self) -> None:
        """Wake the threads waiting in `take_newer` (a node became free to take the newest version)."""
        self._sets.wake()

    # ---- nodes --------------------------------------------------------------------------------

    def add(self, node_id: str, where: Location | None = None) -> None:
        """A node joined (or re-joined: a fresh weight group); it is sent the newest version at once, on
        the path its location `where` gives (a collective when unknown). Its link is the registry's to
        keep and to close (a link of an earlier process of that node is closed by it)."""
        w = self.cfg.weights
        path = self.path_for(where)
        if path in SHARED and self._own_links(path) >= w.fetch_after:
            log.info("node %s: weights by %s, fetched with the others past weights.fetch_after", node_id, path)
            self.registry.attach(node_id, self._fetch(path).add(node_id, NodeWeights(path=path)))
            self.wake()  # its fetch offers it the newest version now
            return
        if path in COLLECTIVE and w.relay_fanout:
            self._relayed(node_id, path)
            return
        log.info("node %s: weights by %s", node_id, path)
        self.link(node_id, NodeWeights(path=path))

    def link(self, node_id: str, state: NodeWeights, relays: bool | None = None) -> None:
        """A link of its own for the node, on the path `state` names (attached: a child it was is closed).
        `relays`: it is a root of the relay tree, which takes children if True (None: not in the tree)."""
        w = self.cfg.weights
        sender = new_sender(state.path, node_id, host=w.store_host, device=self.device, timeout_s=w.timeout_s)
        link = _Link(self, node_id, sender, state)
        if relays is not None:
            link.parent, link.relays = LEARNER, relays
        link.start()
        self.registry.attach(node_id, link)

    def _relayed(self, node_id: str, path: str) -> None:
        """A node on a broadcast path with relaying on: a root (a link) or a child of the shallowest node with room."""
        relays = self.registry.can_relay(node_id)
        parent = self.tree.place()
        if parent == LEARNER:
            log.info("node %s: weights by %s from the learner (a relay root: %s)", node_id, path, relays)
            self.link(node_id, NodeWeights(path=path), relays)
            if relays:
                self.tree.tell(node_id)  # none yet: it keeps a copy of each version from now on
            return
        log.info("node %s: weights by %s, relayed by node %s", node_id, path, parent)
        self.tree.add_child(node_id, parent, NodeWeights(path=path), relays)

    def _own_links(self, path: str) -> int:
        return sum(1 for link in self._links().values() if isinstance(link, _Link) and link.sender.path == path)

    def _fetch(self, path: str) -> SharedFetch:
        """The one thread (and store) that serves every node on `path` past `weights.fetch_after`."""
        if path not in self._fetches:
            w = self.cfg.weights
            sender = new_sender(path, f"{path}-fetch", host=w.store_host, device=self.device, timeout_s=w.timeout_s)
            self._fetches[path] = SharedFetch(self, sender)  # a shared path's sender: an IpcSender
            self._fetches[path].start()
        return self._fetches[path]

    def path_for(self, where: Location | None) -> str:
        """The path weights take to a node at `where` (engine/weights/paths.py; a collective when unknown)."""
        return choose(self.here, where, self.cfg.weights.backend) if where is not None else self.backend

    def poll(self) -> list[tuple[str, str]]:
        """Confirmations in, deadlines checked: the nodes that cannot take the weights, and why (evicting
        them, which closes their links, is the registry's)."""
        now = time.monotonic()
        failed = [(node_id, why) for node_id, link in self._links().items() if (why := self._check(link, now))]
        self.tree.check(now)
        return failed

    def _check(self, link: _Link | Member | Child, now: float) -> str:
        while (applied := self.registry.take_applied(link.node_id)) is not None:
            if isinstance(link, Child) and (why := self.tree.applied(link, applied)):
                return why
            if applied.error and not isinstance(link, Child):
                return f"version {applied.version} failed on the node: {applied.error}"
            if applied.error:
                continue  # moved to another parent, which sends it the newest version
            link.state.applied = max(link.state.applied, applied.version)
            link.state.last_swap_s = applied.seconds
        if link.error is not None:
            return str(link.error)
        # a child's version is 'sent' when handed over, before its transfer (which has a deadline of its own)
        late = now - link.state.sent_at > self.cfg.weights.timeout_s * (2 if isinstance(link, Child) else 1)
        if link.state.sent > link.state.applied and late:
            return (f"version {link.state.sent} was transferred {now - link.state.sent_at:.0f} s ago and is not "
                    f"live on the node (weights.timeout_s = {self.cfg.weights.timeout_s:g})")  # fmt: skip
        return ""

    def states(self) -> dict[str, NodeWeights]:
        """Each node's weights, for the nodes in the run now."""
        return {node_id: link.state for node_id, link in self._links().items()}

    def _links(self) -> dict[str, _Link | Member | Child]:
        return self.registry.links()  # the `_Link`s, `Member`s and `Child`s `add` attached
