"""Weights to a node of the learner's own machine: the node copies them out of memory the learner shares.

The learner packs each version into flat buckets as for a broadcast (`PackedBuckets`); on these paths
the buckets are shared with the node once, and each version the node copies from them into its own
staging buffers:
- `cuda_ipc` (the node on learner rank 0's GPU): the buckets' CUDA IPC handles (torch's
  `_share_cuda_`), plus one interprocess event that the learner records after the packing; the node's
  copy stream waits for that event, so the copy never reads a half-packed bucket.
- `shm` (a CPU learner): the buckets are memfd files (`shared_empty`), which the node maps by path.

The node confirms its copy in the learner's TCPStore (`copied/<version>/<rank>`); the learner holds
that version's buckets (the publisher repacks only a set no transfer holds) until then or until the
deadline. At the deadline the learner claims the same key (`compare_set`): whichever side claims it
first decides, so a node that finishes its copy after the learner gave up throws the copy away instead
of swapping in weights the learner may be repacking. The node writes its key once and never reads it:
the learner deletes it once it read the node's word, and keeps only the claims it won (`forget`), so the
store does not grow with the versions. Handles, events and files are opened once per buffer on the node
(`_Opened`), and again only when the learner's buffers change (a new layout).
"""

from __future__ import annotations

import collections
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from streamrl.engine.messages import BucketSpec, SharedBucket, WeightsReady
from streamrl.engine.weights.layout import BufferPool, PackedBuckets, torch_dtype
from streamrl.engine.weights.paths import WeightTransferError

COPIED, GAVE_UP = "copied", "learner gave up"
STORES_KEPT = 64  # learners' stores a node process keeps open: one per node it runs (a simulation runs many)
POLL_S = (0.0002, 0.01)  # waits poll from 0.2 ms (a copy is ~1 ms on a GPU), doubling up to 10 ms (a dead peer)

# ---- learner side -----------------------------------------------------------------------------

_memfds: dict[int, SharedBucket] = {}  # data_ptr of a buffer made by `shared_empty` -> how a node opens it
_memfds_lock = threading.Lock()


def shared_empty(numel: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """A flat CPU tensor in a memfd that a process of this machine (same user) opens by path. The file
    lives while the tensor does; no file is left behind in /dev/shm when the learner dies."""
    nbytes = max(numel * torch.empty(0, dtype=dtype).element_size(), 1)
    fd = os.memfd_create("streamrl-weights", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        path = f"/proc/{os.getpid()}/fd/{fd}"
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    except BaseException:
        os.close(fd)
        raise
    ptr, key = tensor.data_ptr(), f"{path}#{secrets.token_hex(8)}"
    with _memfds_lock:  # the key is new for every buffer: a reused fd number or address is never an old one
        _memfds[ptr] = SharedBucket(key=key, path=path)
    weakref.finalize(tensor, _release_memfd, ptr, fd, key)
    return tensor


def _release_memfd(ptr: int, fd: int, key: str) -> None:
    with _memfds_lock:
        if ptr in _memfds and _memfds[ptr].key == key:  # not a newer buffer at the same address
            del _memfds[ptr]
    os.close(fd)


def export(flat: torch.Tensor) -> SharedBucket:
    """How a node of this machine opens `flat` (a `shared_empty` buffer, or any CUDA tensor)."""
    if flat.device.type == "cuda":
        fields = flat.untyped_storage()._share_cuda_()
        return SharedBucket(key=f"cuda:{fields[1].hex()}:{fields[3]}", cuda=tuple(fields))
    with _memfds_lock:
        shared = _memfds.get(flat.data_ptr())
    if shared is None:
        raise ValueError("a CPU bucket to share must come from ipc.shared_empty (weights.pack makes such buckets)")
    return shared


class IpcSender:
    """Learner rank 0's end of one node on its own machine: the same calls as `WeightSender`
    (`prepare` → the node gets the `WeightsReady` → `send`), over shared buffers."""

    def __init__(
        self,
        node_id: str,
        receivers: int = 1,
        *,
        host: str = "127.0.0.1",
        device: torch.device | str = "cpu",
        timeout_s: float = 60.0,
    ):
        from streamrl.engine.weights.collective import open_store

        self.node_id, self.receivers, self.host, self.timeout_s = node_id, receivers, host, timeout_s
        self.device = torch.device(device)
        self.path = "cuda_ipc" if self.device.type == "cuda" else "shm"
        self.store = open_store(node_id, host, timeout_s)
        self._prefix = f"weights/{node_id}/shared-{secrets.token_hex(16)}/"  # travels over the control channel only
        self._exports: dict[int, tuple[weakref.ref, SharedBucket]] = {}  # id(buffer) -> (the buffer, export)
        self._event = self._stream = None
        self._closed = threading.Event()

    @property
    def port(self) -> int:
        return self.store.port

    @property
    def prefix(self) -> str:
        """Its keys' prefix in the store (secret: it travels over the control channel only)."""
        return self._prefix

    @property
    def buffer_device(self) -> torch.device:
        return self.device

    def prepare(
        self, version: int, packed: PackedBuckets, packed_event: torch.cuda.Event | None = None
    ) -> WeightsReady:
        """The `WeightsReady` naming the packed buckets. `packed_event`: recorded after the packing on
        the learner's stream; the interprocess event the node waits for is recorded behind it."""
        if not isinstance(packed, PackedBuckets):
            raise TypeError(f"the {self.path} path shares packed buckets, not {type(packed).__name__}")
        shared = [self._export(packed.get(i)) for i in range(len(packed))]
        return WeightsReady(
            version=version, store_host=self.host, store_port=self.port, group_prefix=self._prefix,
            world_size=1 + self.receivers, timeout_s=self.timeout_s, buckets=packed.specs, backend=self.path,
            shared=shared, packed_event=self._record(packed_event),
        )  # fmt: skip

    def _export(self, flat: torch.Tensor) -> SharedBucket:
        """Each buffer is shared once, not per version. Known by the tensor object itself, never by its
        address: a new buffer may be given a freed one's address, and must not be taken for it."""
        known = self._exports.get(id(flat))
        if known is None or known[0]() is not flat:
            self._exports = {k: v for k, v in self._exports.items() if v[0]() is not None}  # buffers gone
            known = self._exports[id(flat)] = (weakref.ref(flat), export(flat))
        return known[1]

    def _record(self, packed_event: torch.cuda.Event | None) -> bytes:
        if self.device.type != "cuda":
            return b""
        if self._event is None:
            self._event = torch.cuda.Event(interprocess=True)
            self._stream = torch.cuda.Stream(self.device)
        if packed_event is not None:
            self._stream.wait_event(packed_event)
        else:  # packed by the caller's stream just now
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._event.record(self._stream)
        return self._event.ipc_handle()

    def send(
        self,
        packed: PackedBuckets,
        ready: WeightsReady,
        packed_event: torch.cuda.Event | None = None,
        *,
        on_bucket: Callable[[str, int], None] | None = None,
    ) -> float:
        """Wait until every receiver confirmed its copy of `ready`'s version (one deadline, `timeout_s`);
        the seconds it took. Nothing is sent from here: the node reads the shared buffers itself. The call
        of every sender (staging.Sender); `packed_event` was used by `prepare`. `on_bucket(node_id, index)`
        (a test's hook) is called as each bucket is handed to the node: all of them at once, before the
        wait (they were shared when prepared; the node copies them as soon as it has the `WeightsReady`)."""
        start, deadline = time.perf_counter(), time.monotonic() + self.timeout_s
        for index in range(len(packed)) if on_bucket is not None else ():
            on_bucket(self.node_id, index)
        for rank in range(1, 1 + self.receivers):
            outcome = self._outcome(_copied_key(ready, rank), deadline)
            if outcome != COPIED:
                raise WeightTransferError(
                    self.node_id, "open" if outcome.startswith("cannot open") else "copy", outcome
                )
        return time.perf_counter() - start

    def _outcome(self, key: str, deadline: float) -> str:
        pause = POLL_S[0]
        while not self._closed.is_set():
            if self.store.check([key]):
                return forget(self.store, key, self.store.get(key).decode())
            if time.monotonic() > deadline:
                break
            time.sleep(pause)
            pause = min(2 * pause, POLL_S[1])
        won = self.store.compare_set(key, "", GAVE_UP).decode()
        if won != GAVE_UP:
            return forget(self.store, key, won)  # the node's word came in the same instant
        why = "the sender was closed" if self._closed.is_set() else f"no confirmation within {self.timeout_s:g} s"
        return f"{why}: the node did not copy the version from the shared buffers"

    def mark_broken(self) -> None:
        """Nothing to rebuild: each version has its own keys."""

    def close(self) -> None:
        self._closed.set()


def _copied_key(ready: WeightsReady, rank: int) -> str:
    return f"{ready.group_prefix}copied/{ready.version}/{rank}"


def forget(store: dist.Store, key: str, outcome: str) -> str:
    """`outcome`, read from `key`; the key deleted if the node wrote it (its one write, `receive_shared`'s
    `compare_set`: nobody reads it again), kept if the learner's claim won: a late node's `compare_set` on a
    missing key would succeed, and it would swap in a copy of buffers the learner may be repacking. A claim
    is kept for the store's life (one per give-up, and a give-up evicts its node: bounded by failures, not
    by versions)."""
    if outcome != GAVE_UP:
        store.delete_key(key)
    return outcome


# ---- node side --------------------------------------------------------------------------------


class _Opened:
    """The learner's buffers this process has opened, by key (a few sets: the learner cycles through
    two or three), the events and the stores; opening a CUDA IPC handle costs ~10 ms, so it is done once."""

    def __init__(self, keep: int = 16):
        self.keep = keep
        self.buffers: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
        self.events: dict[bytes, torch.cuda.Event] = {}
        self.stores: dict[tuple[str, int], dist.Store] = {}
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.lock = threading.Lock()

    def buffer(self, shared: SharedBucket, spec: BucketSpec, device: torch.device) -> torch.Tensor:
        with self.lock:
            flat = self.buffers.get(shared.key)
            if flat is None:
                flat = self.buffers[shared.key] = _open(shared, spec, device)
                while len(self.buffers) > self.keep:
                    self.buffers.popitem(last=False)
            self.buffers.move_to_end(shared.key)
            return flat

    def event(self, handle: bytes, device: torch.device) -> torch.cuda.Event:
        with self.lock:
            if handle not in self.events:
                self.events[handle] = torch.cuda.Event.from_ipc_handle(device, handle)
            return self.events[handle]

    def store(self, ready: WeightsReady) -> dist.Store:
        import datetime

        key = (ready.store_host, ready.store_port)
        with self.lock:
            if key not in self.stores:
                # one store per node this process serves (the learner opens one per node; a process may run
                # several simulated nodes, bench/scale_out.py): the oldest goes, as a restarted learner's do
                while len(self.stores) >= STORES_KEPT:
                    self.stores.pop(next(iter(self.stores)))
                timeout = datetime.timedelta(seconds=ready.timeout_s)
                self.stores[key] = dist.TCPStore(ready.store_host, ready.store_port, is_master=False, timeout=timeout)
            return self.stores[key]

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        with self.lock:
            if device not in self.streams:
                self.streams[device] = torch.cuda.Stream(device)
            return self.streams[device]


_opened = _Opened()


def _open(shared: SharedBucket, spec: BucketSpec, device: torch.device) -> torch.Tensor:
    dtype = torch_dtype(spec.dtype)
    if shared.cuda is None:
        return torch.from_file(shared.path, shared=True, size=spec.numel, dtype=dtype)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    _, handle, size, offset, counter, counter_offset, event, sync = shared.cuda
    index = device.index if device.index is not None else torch.cuda.current_device()  # ours, not the learner's
    return rebuild_cuda_tensor(
        torch.Tensor, (spec.numel,), (1,), 0, torch.storage.TypedStorage, dtype, index, handle, size, offset,
        False, counter, counter_offset, event, sync,
    )  # fmt: skip


def receive_shared(
    ready: WeightsReady, device: torch.device, rank: int, pool: BufferPool
) -> tuple[list[torch.Tensor], float]:
    """Copy every bucket of `ready` from the learner's shared buffers into `pool`'s buffers on `device`
    and confirm it; the flat copies and the copy's device time (0 on CPU). Raises `WeightTransferError`
    naming the phase: 'open' (the buffers cannot be reached from here: another PID namespace or
    container), 'copy' (past the deadline, or the learner gave up first)."""
    peer, deadline = f"learner@{ready.store_host}:{ready.store_port}", time.monotonic() + ready.timeout_s
    store, key = _opened.store(ready), _copied_key(ready, rank)
    try:
        sources = [_opened.buffer(s, spec, device) for s, spec in zip(ready.shared, ready.buckets)]
    except Exception as e:
        why = f"cannot open the learner's {ready.backend} buffers ({type(e).__name__}: {e}); a node in another " \
              "container or PID namespace cannot: set weights.backend = 'gloo' (CPU) or 'nccl' (GPU)"  # fmt: skip
        store.compare_set(key, "", why)
        raise WeightTransferError(peer, "open", why) from e
    flats = [pool.take(i, torch_dtype(b.dtype), b.numel, device) for i, b in enumerate(ready.buckets)]
    copy_s = 0.0
    if device.type == "cuda":
        copy_s = _copy_on_stream(ready, flats, sources, device, deadline, pool)
    else:
        for flat, source in zip(flats, sources):
            flat.copy_(source)
    if store.compare_set(key, "", COPIED).decode() != COPIED:
        raise WeightTransferError(peer, "copy", f"the learner gave up on version {ready.version} first "
                                  f"(weights.timeout_s = {ready.timeout_s:g}); the copy is thrown away")  # fmt: skip
    return flats, copy_s


def _copy_on_stream(ready, flats, sources, device, deadline: float, pool: BufferPool) -> float:
    """The copies on this process's own stream, behind the learner's packing (its interprocess event),
    polled to the deadline: a node never blocks on a learner that stopped."""
    stream = _opened.stream(device)
    with torch.cuda.stream(stream):
        if ready.packed_event:
            stream.wait_event(_opened.event(ready.packed_event, device))
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for flat, source in zip(flats, sources):
            flat.copy_(source, non_blocking=True)
        done.record(stream)
    pause = POLL_S[0]
    while not done.query():
        if time.monotonic() > deadline:
            for flat in flats:  # the late copy may still land: these buffers are not handed out again
                flat.record_stream(stream)
            pool.clear()
            raise WeightTransferError(f"learner@{ready.store_host}:{ready.store_port}", "copy",
                                      f"the copy did not finish within {ready.timeout_s:g} s")  # fmt: skip
        time.sleep(pause)
        pause = min(2 * pause, POLL_S[1])
    return start.elapsed_time(done) / 1000


__all__ = ["IpcSender", "export", "receive_shared", "shared_empty"]
