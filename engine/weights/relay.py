"""A node's end of the relay tree: each version it receives on a broadcast path (gloo, NCCL) it forwards to the
nodes the learner gave it (learner/relay_tree.py), with the sender the learner runs (`collective.WeightSender`:
a TCPStore and a 2-rank group per child, this node as rank 0), so the learner sends each version to a few nodes
only, not to every node of every other host.

A node in the tree keeps its own copy of the newest version it received: its staging buffers are released at the
swap and reused by its next receive, and a slow child must not hold them (nor, through them, this node's own next
version). That is one copy of the weights more on every node of the tree that can relay (a leaf too: it may be
given an orphan at any time, which must not wait for the next version), two while a child reads an older one.
Each child has a thread that sends it the newest copy newer than what it has, skipping to the newest as the
learner's link does. The copy is posted when the node's own receive starts and fills bucket by bucket as the
buckets land (`ArrivingBuckets`), so a child's send forwards each bucket as soon as it is here (cut-through): a
version reaches a depth-d node about one transfer plus d buckets after the learner sends it, not d transfers.
The child's `WeightsReady` names this node's store and goes to the learner (`announce`,
sent as a `Relayed` message), which hands it on over the child's own control channel: the child receives as
from the learner (`collective.receive_flat`), and the learner knows when each child was sent each version.
A send that fails breaks that child's group only (a new one next time); the child reports its failure to the
learner, which gives it another parent.

Where the stores listen: this node's address on the route to the store that sent it its own version, the
address the learner (or its own parent) reaches it at; its children are told it in their `WeightsReady`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import torch

from streamrl.engine.messages import BucketSpec, WeightsReady
from streamrl.engine.weights.collective import WeightSender, address_towards
from streamrl.engine.weights.layout import BufferPool, PackedBuckets, torch_dtype
from streamrl.engine.weights.newest import Newest
from streamrl.engine.weights.paths import COLLECTIVE, WeightTransferError
from streamrl.engine.weights.push import push

log = logging.getLogger("streamrl.rollout")

WAIT_S = 0.2  # how long a child's thread waits for a newer version before it looks at its stop flag again


class ArrivingBuckets(PackedBuckets):
    """A relay's copy of a version while it arrives: `get(i)` (a child's send) waits until bucket i has landed and
    been copied (`arrive`), at most the version's deadline; every wait raises once the receive failed (`fail`)."""

    def __init__(self, specs: list[BucketSpec], copies: list[torch.Tensor], timeout_s: float):
        super().__init__(specs, {}, copies[0].device if copies else "cpu")
        self._copies, self.timeout_s = copies, timeout_s
        self._landed = [threading.Event() for _ in copies]
        self.failure = ""

    def arrive(self, index: int, flat: torch.Tensor) -> None:
        self._copies[index].copy_(flat)
        if flat.device.type == "cuda":  # a child's broadcast runs on its own stream: the copy must be done first
            torch.cuda.current_stream(flat.device).synchronize()
        self._landed[index].set()

    def fail(self, why: str) -> None:
        self.failure = why
        for landed in self._landed:
            landed.set()

    def get(self, index: int) -> torch.Tensor:
        if not self._landed[index].wait(self.timeout_s):
            raise TimeoutError(f"bucket {index + 1}/{len(self)} did not reach this relay in {self.timeout_s:g} s")
        if self.failure:
            raise RuntimeError(f"this relay's own receive failed: {self.failure}")
        return self._copies[index]


@dataclasses.dataclass
class _Held:
    """This node's copy of one version, read by the children's sends while it arrives and after."""

    ready: WeightsReady
    packed: ArrivingBuckets
    pool: BufferPool
    relay: Relay
    readers: int = 0

    @property
    def version(self) -> int:
        return self.ready.version

    def arrived(self, index: int, flat: torch.Tensor) -> None:
        """Bucket `index` landed in the node's staging buffer `flat` (released after the swap): copied here."""
        self.packed.arrive(index, flat)

    def failed(self, why: str) -> None:
        """The node's receive of this version failed: the sends reading it fail (each child reports it, and the
        learner gives it another parent), and no later child is given it."""
        self.packed.fail(why)
        self.relay.withdraw(self)


class Relay:
    """Forwards every version this node receives to its children (`assign`); `receiving` is called as each one
    starts to arrive."""

    def __init__(self, node_id: str, announce: Callable[[str, WeightsReady], None]):
        self.node_id, self.announce = node_id, announce
        self.host = ""  # where its stores listen: known from the first version it receives
        self._cond = threading.Condition()  # guards the children and the copies (one lock: `_copies` shares it)
        self._copies: Newest[_Held] = Newest(self._cond)  # the versions it received, read by the children's sends
        self._children: dict[str, _ChildSender] = {}
        self._in_tree = False  # the learner placed it in its relay tree (a first `assign`, children or not)

    def assign(self, children: list[str], versions: list[int]) -> None:
        """The learner's whole list of this node's children and the version each holds: new ones are sent the
        newest version held at once (if newer), dropped ones are no longer served."""
        with self._cond:
            for child in set(self._children) - set(children):
                self._children.pop(child).close()
            for child, have in zip(children, versions, strict=True):
                if child not in self._children:
                    self._children[child] = _ChildSender(self, child, have)
                    self._children[child].start()
            self._in_tree = True  # told by the learner: it may be given children any time from now
            self._cond.notify_all()
        log.info("node %s relays weights to %d nodes: %s", self.node_id, len(children), ", ".join(children))

    def expect(self, ready: WeightsReady) -> None:
        """A version on its way to this node (the control thread's word): nothing to do here, where each layout for
        a child goes out as it is made; a relay in another process asks for them sooner then
        (rollout/backends/vllm_relay.py)."""

    def children(self) -> list[str]:
        with self._cond:
            return list(self._children)

    def receiving(self, ready: WeightsReady, device: torch.device) -> _Held | None:
        """A version this node starts to receive on a broadcast path, onto `device`: its copy, posted at once, so
        that each child's send forwards every bucket as it lands (`_Held.arrived`, which the receive calls), not
        the whole version after the last one; `_Held.failed` if the receive fails. Made once the learner placed
        this node in its tree, children or not (a child it is given later, one whose parent left, is sent this
        copy at once rather than waiting for the next version). None on a shared path (the copy is local) or
        for a node outside the tree."""
        if ready.backend not in COLLECTIVE:
            return None
        if not self.host:
            self.host = address_towards(ready.store_host, ready.store_port)
        with self._cond:
            if not self._in_tree:
                return None
            free = self._copies.reuse()  # out of every reader's reach while it is written
        pool = free.pool if free is not None else BufferPool()
        copies = [pool.take(i, torch_dtype(spec.dtype), spec.numel, device) for i, spec in enumerate(ready.buckets)]
        held = _Held(ready, ArrivingBuckets(ready.buckets, copies, ready.timeout_s), pool, self)
        self._copies.post(held)
        return held

    def take_newer(self, than: int, timeout_s: float) -> _Held | None:
        """The newest copy if newer than `than` (held until `give_back`), else None after `timeout_s`."""
        return self._copies.take_newer(than, timeout_s)

    def give_back(self, held: _Held) -> None:
        self._copies.give_back(held)

    def withdraw(self, held: _Held) -> None:
        """A copy whose version failed to arrive: given to no child from now on."""
        self._copies.withdraw(held)

    def close(self) -> None:
        """The node stops: no child is served any more."""
        with self._cond:
            for child in self._children.values():
                child.close()
            self._children.clear()
            self._cond.notify_all()


class _ChildSender(threading.Thread):
    """One child's sends: the newest held version it lacks, over its own store and group on this node."""

    def __init__(self, relay: Relay, child: str, have: int):
        super().__init__(name=f"relay-{child}", daemon=True)
        self.relay, self.child, self.sent = relay, child, have
        self.sender: WeightSender | None = None
        self.stopping = threading.Event()

    def close(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        while not self.stopping.is_set():
            held = self.relay.take_newer(self.sent, WAIT_S)
            if held is None:
                continue
            try:
                self._send(held)
            except WeightTransferError as e:  # the child reports it too; the learner gives it another parent
                log.warning("relay of version %d to node %s failed: %s", held.version, self.child, e)
            finally:
                self.sent = max(self.sent, held.version)  # a failed version is not retried: the next one is sent
                self.relay.give_back(held)
        if self.sender is not None:
            self.sender.close()

    def _send(self, held: _Held) -> None:
        if self.sender is None:
            ready = held.ready
            self.sender = WeightSender(self.child, host=self.relay.host, backend=ready.backend,
                                       device=held.packed.device, timeout_s=ready.timeout_s)  # fmt: skip
        push(self.sender, held.version, held.packed, lambda ready: self.relay.announce(self.child, ready),
             adapter=held.ready.adapter)  # fmt: skip
