"""The learner's end of one push, the same whatever receives it: `pack` a version, then `push` it to a node.

`push` is the one order of steps: the sender's layout (`WeightsReady`, with the LoRA adapter's spec when the
buckets hold an adapter), handed to the node by a deliverer, then the send, which returns when the node holds
the version; a failure is a `WeightTransferError` naming the node and the phase. The learner's link
(learner/publisher.py `_Link`) delivers over the registry's control channel; `push_in_process` delivers
to an engine of this process (its `update_weights`, or a node's `apply_weights`) for the rollout bench and
the tests, which push exactly as the link does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Mapping

import msgspec
import torch

from streamrl.engine.messages import AdapterSpec, BucketSpec, WeightsReady
from streamrl.engine.weights.ipc import shared_empty
from streamrl.engine.weights.layout import BufferPool, PackedBuckets
from streamrl.engine.weights.paths import WeightTransferError
from streamrl.engine.weights.staging import Sender


def pack(
    specs: list[BucketSpec],
    weights: Mapping[str, torch.Tensor],
    device: torch.device | str,
    pool: BufferPool | None = None,
    *,
    check: bool = True,
) -> PackedBuckets:
    """`weights` packed now into the buckets `specs` lays out (layout.plan_buckets), on `device`: the caller may
    change `weights` once this returns (on a GPU, once the packing's copies ran: the caller's stream). `pool`:
    buffers kept from an earlier version of the same layout; a new one keeps its CPU buffers in memory other
    processes can map (ipc.shared_empty), so every path reads the same buckets."""
    packed = PackedBuckets(specs, weights, device, pool or BufferPool(allocate=shared_empty), check=check)
    with torch.no_grad():
        for i in range(len(packed)):
            packed.get(i)
    return packed


def push(
    sender: Sender,
    version: int,
    packed: PackedBuckets,
    deliver: Callable[[WeightsReady], object],
    *,
    adapter: AdapterSpec | None = None,
    packed_event: torch.cuda.Event | None = None,
    on_bucket: Callable[[str, int], None] | None = None,
) -> float:
    """`version` to the node at the other end of `sender`: its layout handed to `deliver`, which returns once the
    node has it (raises when it cannot be delivered), then the send; the send's seconds. `adapter`: the buckets
    hold this LoRA adapter, not the full weights. Raises `WeightTransferError` (phase 'layout' when the delivery
    failed)."""
    ready = sender.prepare(version, packed, packed_event)
    if adapter is not None:
        ready = msgspec.structs.replace(ready, adapter=adapter)
    try:
        deliver(ready)
    except Exception as e:
        raise WeightTransferError(sender.node_id, "layout", f"{type(e).__name__}: {e}") from e
    return sender.send(packed, ready, packed_event=packed_event, on_bucket=on_bucket)


async def push_in_process(
    sender: Sender,
    version: int,
    packed: PackedBuckets,
    update_weights: Callable[[WeightsReady], Awaitable[float]],
    *,
    adapter: AdapterSpec | None = None,
) -> float:
    """`push` into an engine of this process: the send in a thread (as the learner's link runs it), the engine's
    `update_weights(ready)` (receive, swap) on this loop. Returns the engine's seconds once both ended; raises
    the send's error, else the engine's (the engine is waited for either way: it holds no half-received
    version when this returns)."""
    loop = asyncio.get_running_loop()
    swaps: list[concurrent.futures.Future] = []

    def deliver(ready: WeightsReady) -> None:  # in the send's thread: the engine's part goes to this loop
        swaps.append(asyncio.run_coroutine_threadsafe(update_weights(ready), loop))

    sending = asyncio.ensure_future(asyncio.to_thread(push, sender, version, packed, deliver, adapter=adapter))
    await asyncio.wait([sending])
    swapped = await asyncio.gather(*map(asyncio.wrap_future, swaps), return_exceptions=True)  # delivered: none or one
    sending.result()
    for outcome in swapped:
        if isinstance(outcome, BaseException):
            raise outcome
    return swapped[0]
