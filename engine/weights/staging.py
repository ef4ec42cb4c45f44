"""The two ends every path shares: `new_sender` (learner rank 0, one per node) and `Stager` (the node).

A sender (`collective.WeightSender` or `ipc.IpcSender`) answers the same three calls: `prepare(version,
packed, packed_event)` gives the node's `WeightsReady`; once the node has it, `send(packed, ready,
packed_event, on_bucket=...)` returns when the node holds the version (its broadcast ended, or it confirmed its copy
from the shared buffers), within one deadline; `close()`. The node's `Stager` receives whichever path
`ready.backend` names into staging buffers while its engine keeps generating.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from streamrl.engine.messages import AdapterSpec, WeightsReady
from streamrl.engine.weights.collective import WeightSender, buffer_device, receive_flat
from streamrl.engine.weights.ipc import IpcSender, receive_shared
from streamrl.engine.weights.layout import BufferPool, PackedBuckets, unpack_bucket
from streamrl.engine.weights.paths import SHARED, WeightTransferError

if TYPE_CHECKING:
    from streamrl.engine.weights.relay import Relay

log = logging.getLogger("streamrl.rollout")


class Sender(Protocol):
    """Learner rank 0's end of one node's weights, on one path."""

    node_id: str
    timeout_s: float

    @property
    def path(self) -> str: ...

    def prepare(
        self, version: int, packed: PackedBuckets, packed_event: torch.cuda.Event | None = None
    ) -> WeightsReady: ...

    def send(
        self,
        packed: PackedBuckets,
        ready: WeightsReady,
        packed_event: torch.cuda.Event | None = None,
        *,
        on_bucket: Callable[[str, int], None] | None = None,
    ) -> float: ...

    def close(self) -> None: ...


def new_sender(path: str, node_id: str, *, host: str, device: torch.device, timeout_s: float) -> Sender:
    """The sender for `path` ('gloo', 'nccl', 'shm', 'cuda_ipc'; paths.choose picks it)."""
    if path in SHARED:
        return IpcSender(node_id, host=host, device=device if path == "cuda_ipc" else "cpu", timeout_s=timeout_s)
    return WeightSender(node_id, host=host, backend=path, device=device, timeout_s=timeout_s)


@dataclasses.dataclass
class Staged:
    """A version received into staging buffers, not yet live in the engine."""

    version: int
    named: list[tuple[str, torch.Tensor]]  # views into the staging buffers
    seconds: float  # from the layout's arrival to the last byte
    nbytes: int
    path: str = ""  # how it came: ready.backend
    copy_s: float = 0.0  # the shared CUDA path: the node's copy out of the learner's buffers, device time
    adapter: AdapterSpec | None = None  # LoRA: `named` is this adapter of `version` (ready.adapter)


class Stager:
    """Receives versions into one set of staging buffers while the engine keeps generating.

    `receive` blocks its caller (a thread of its own, never the engine's) until the version is
    staged; the engine swaps it in at its next safe point and calls `release`, which frees the buffers
    for the next version. A version that arrives while one is staged waits for that swap (at most the
    transfer's deadline): staging memory stays at one copy of the weights (`nbytes`).
    """

    def __init__(self, device: torch.device | str, rank: int = 1):
        self.device, self.rank = torch.device(device), rank
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" != "cuda:0": buffers would not be reused
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._free = threading.Event()
        self._free.set()
        self._pool = BufferPool()  # the shared paths' staging (a collective receives into its group's buffers)
        self.nbytes = 0
        self.relay: Relay | None = None  # a relay node's forwarding (engine/weights/relay.py), set by its node

    def receive(self, ready: WeightsReady) -> Staged:
        start, peer = time.perf_counter(), f"learner@{ready.store_host}:{ready.store_port}"
        if not self._free.wait(ready.timeout_s):
            raise WeightTransferError(peer, "staging", f"version {ready.version} arrived while the previous one "
                                      f"waited {ready.timeout_s:g} s for the engine to swap it in")  # fmt: skip
        self._free.clear()
        copy_s = 0.0
        try:
            if ready.backend in SHARED:
                flats, copy_s = receive_shared(ready, self.device, self.rank, self._pool)
            else:
                relayed = self._relayed(ready)
                try:
                    flats = receive_flat(ready, self.device, self.rank, self._forward(relayed))
                except BaseException as e:
                    if relayed is not None:
                        relayed.failed(f"{type(e).__name__}: {e}")
                    raise
        except BaseException as e:
            self._free.set()
            if isinstance(e, Exception) and not isinstance(e, WeightTransferError):
                raise WeightTransferError(peer, ready.backend, f"{type(e).__name__}: {e}") from e
            raise
        named = [item for spec, flat in zip(ready.buckets, flats) for item in unpack_bucket(spec, flat)]
        self.nbytes = sum(f.numel() * f.element_size() for f in flats)
        seconds = time.perf_counter() - start
        return Staged(ready.version, named, seconds, self.nbytes, ready.backend, copy_s, ready.adapter)

    def _relayed(self, ready: WeightsReady):
        """The relay's copy of this version, filled as it lands (engine/weights/relay.py), or None: no relay, or a
        relay that failed to make one (its children lack this version only; the node never lacks its own)."""
        if self.relay is None:
            return None
        try:
            return self.relay.receiving(ready, buffer_device(ready, self.device))
        except Exception as e:  # noqa: BLE001 - the children report their missing version; the learner re-parents
            log.warning("version %d not relayed: %s: %s", ready.version, type(e).__name__, e)
            return None

    def _forward(self, relayed):
        """What the receive calls as each bucket lands: the relay's copy takes it (a failed copy fails the
        children's sends, never the node's own receive)."""
        if relayed is None:
            return None

        def arrived(index: int, flat: torch.Tensor) -> None:
            try:
                relayed.arrived(index, flat)
            except Exception as e:  # noqa: BLE001 - as above
                log.warning("version %d not relayed: %s: %s", relayed.version, type(e).__name__, e)
                relayed.failed(f"{type(e).__name__}: {e}")

        return arrived

    def release(self) -> None:
        """The staged version is live (or given up): the buffers take the next one."""
        self._free.set()
