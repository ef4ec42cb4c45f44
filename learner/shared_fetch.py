"""Weights to many nodes of the learner's machine at once: one thread and one store for all of them.

A node on a shared path (shared memory, CUDA IPC) copies each version out of the learner's packed buffers
itself; the learner only tells it and waits for its word. With a `_Link` a node (learner/publisher.py) that
is a thread, a TCPStore and a confirmation poll per node per version: at width the push's whole cost, and
linear in the nodes (0.012 s to the last of 8 nodes, 0.24 s to 128, 0.95 s to 256; docs/SCALE.md). Here the
nodes past `weights.fetch_after` are members of one `SharedFetch`: per version, one `WeightsReady` is
prepared and queued to every idle member in one pass (each member its own confirmation key, under a prefix
of its own), and one `check` of the store asks for every member's key at once. The node's side is the one
every shared path runs (ipc.receive_shared: copy, claim `copied` in the store, swap, `WeightsApplied`).

What a link gives a node, a member keeps: a member is busy with one version at a time and skips to the
newest; it is free for the next version once its copy is confirmed, or once it said the version is live,
whatever the other members do, so a slow or frozen member delays only itself. A version's buffers are
held until every member of its round confirmed or was given up on (at `weights.timeout_s`, claimed in the
store as a link claims it: `ipc.GAVE_UP`), so the learner never repacks a set a node still reads. A member's
confirmation key is deleted once its round read it (the node writes it once and never reads it); a claim the
learner won is kept (ipc.forget says why): the store holds no key per version. A member whose node left
(evicted, lost, said goodbye) is dropped from its round at once. The fetch keeps no list of nodes: a member hangs on
its node's entry in the registry as a link does, and each look asks the registry.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from streamrl.engine.weights.ipc import COPIED, GAVE_UP, POLL_S, IpcSender
from streamrl.engine.weights.paths import WeightTransferError

if TYPE_CHECKING:
    from streamrl.learner.publisher import NodeWeights, Publisher, _Set


class Member:
    """One node served by a `SharedFetch`: what the publisher reads of a link (`node_id`, `state`, `error`)
    and what the registry calls when the node leaves (`close`)."""

    def __init__(self, fetch: SharedFetch, node_id: str, state: NodeWeights, prefix: str):
        self.fetch, self.node_id, self.state, self.prefix = fetch, node_id, state, prefix
        self._wake = fetch.publisher.wake
        self.error: WeightTransferError | None = None
        self.closed = threading.Event()
        self.busy_with = 0  # the version of the round it is in (0: none); offered no other until freed

    def close(self) -> None:
        self.closed.set()
        self._wake()

    def key(self, version: int) -> str:
        return f"{self.prefix}copied/{version}/1"  # ipc._copied_key of the WeightsReady it is sent (rank 1)

    def confirmed(self, version: int, seconds: float) -> None:
        self.state.sent, self.state.sent_at = version, time.monotonic()
        self.state.transfers += 1
        self.state.last_transfer_s = seconds
        self.free(version)

    def free(self, version: int) -> None:
        if self.busy_with == version:  # not a newer round it joined meanwhile
            self.busy_with = 0
            self._wake()  # the thread offers it the newest version now, not at its next look


class SharedFetch(threading.Thread):
    """The one thread that serves every member: a round per version, each on a thread of its own while it
    waits for its members' copies (rounds overlap: a member freed from one joins the next)."""

    def __init__(self, publisher: Publisher, sender: IpcSender):
        super().__init__(name=f"weights-{sender.path}-fetch", daemon=True)
        self.publisher, self.sender = publisher, sender
        self._lock = threading.Lock()  # the sender's export cache (rounds prepare at once)
        self.stopping = threading.Event()

    @property
    def path(self) -> str:
        return self.sender.path

    def add(self, node_id: str, state: NodeWeights) -> Member:
        """A member for `node_id`, for the caller to attach to the node's entry in the registry (which closes
        a re-joining node's earlier one); it is sent the newest version once attached."""
        return Member(self, node_id, state, f"{self.sender.prefix}{secrets.token_hex(8)}/")

    def _members(self) -> list[Member]:
        """This fetch's members: the links the registry holds for the nodes in the run now that are ours (the
        registry is the one roster; a node that left is no longer there)."""
        links = self.publisher.registry.links().values()
        return [m for m in links if isinstance(m, Member) and m.fetch is self and not m.closed.is_set()]

    def run(self) -> None:
        while not self.stopping.is_set():
            idle = [m for m in self._members() if not m.busy_with and m.error is None]
            than = min((m.state.sent for m in idle), default=sys.maxsize)  # none idle: woken by one freed
            published = self.publisher.take_newer(than, timeout_s=POLL_IDLE_S)
            if published is None:
                continue
            behind = [m for m in idle if m.state.sent < published.version]
            for member in behind:
                member.busy_with = published.version
            threading.Thread(target=self._round, args=(published, behind), name=f"weights-round-{published.version}",
                             daemon=True).start()  # fmt: skip

    def close(self) -> None:
        self.stopping.set()
        self.sender.close()

    def _round(self, published: _Set, members: list[Member]) -> None:
        """`published` to `members`: one `WeightsReady` to each, then their copies waited for together; the
        confirmation keys read are deleted last, once the members are free and the set given back (256 deletes
        are ~15 ms of round trips to the store, which would hold both)."""
        spent: list[str] = []
        try:
            with self._lock:
                ready = self.sender.prepare(published.version, published.packed, published.event)
            if self.publisher.adapter is not None:
                ready = msgspec.structs.replace(ready, adapter=self.publisher.adapter)
            registry, timeout_s = self.publisher.registry, self.sender.timeout_s
            replace = msgspec.structs.replace
            sends = [(m, registry.send(m.node_id, replace(ready, group_prefix=m.prefix))) for m in members]
            start, delivered = time.perf_counter(), []
            for member, sent in sends:
                try:
                    sent.result(timeout=timeout_s)
                    delivered.append(member)
                except Exception as e:  # noqa: BLE001 - the node's own failure; reported, evicted
                    self._fail(member, "layout", f"{type(e).__name__}: {e}")
            self._wait_copied(published.version, delivered, start, time.monotonic() + timeout_s, spent)
        finally:
            for member in members:
                member.free(published.version)
            self.publisher.give_back(published)
            for key in spent:
                self.sender.store.delete_key(key)

    def _wait_copied(
        self, version: int, members: list[Member], start: float, deadline: float, spent: list[str]
    ) -> None:
        """Until each member's copy of `version` is confirmed (its key in the store, or its version live), it
        left, or the deadline: one `check` of every waiting key a poll, a claim per member only at the end.
        `spent` gets the keys the nodes wrote (each writes its key once and never reads it); a claim the
        learner won stays in the store (ipc.forget says why)."""
        store, pause = self.sender.store, POLL_S[0]
        waiting = list(members)
        while waiting and time.monotonic() < deadline and not self.stopping.is_set():
            for member in [m for m in waiting if m.state.applied >= version]:  # live: its copy was confirmed
                member.confirmed(version, time.perf_counter() - start)
                spent.append(member.key(version))  # confirmed in the store before the node swapped it in
            waiting = [m for m in waiting if m.state.applied < version and not m.closed.is_set()]
            if waiting and store.check([m.key(version) for m in waiting]):
                self._settle(version, waiting, store.multi_get([m.key(version) for m in waiting]), start, spent)
                waiting = []
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        late = [m for m in waiting if not m.closed.is_set()]
        self._settle(version, late, [store.compare_set(m.key(version), "", GAVE_UP) for m in late], start, spent)
        for member in members:  # left mid-copy: its process may still read the buffers, so the learner claims
            if member.closed.is_set() and member.state.sent < version:
                if store.compare_set(member.key(version), "", GAVE_UP).decode() != GAVE_UP:
                    spent.append(member.key(version))  # its word came first

    def _settle(
        self, version: int, members: list[Member], outcomes: list[bytes], start: float, spent: list[str]
    ) -> None:
        seconds = time.perf_counter() - start
        for member, outcome in zip(members, outcomes, strict=True):
            said = outcome.decode()
            if said != GAVE_UP:
                spent.append(member.key(version))
            if said == COPIED:
                member.confirmed(version, seconds)
            elif said == GAVE_UP:
                why = f"no confirmation within {self.sender.timeout_s:g} s: the node did not copy the version"
                self._fail(member, "copy", why)
            else:
                self._fail(member, "open" if said.startswith("cannot open") else "copy", said)

    def _fail(self, member: Member, phase: str, why: str) -> None:
        member.error = WeightTransferError(member.node_id, phase, why)


POLL_IDLE_S = 0.2  # how long the thread waits for a version or a member before it looks again
