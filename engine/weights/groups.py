"""Process groups for weight transfer: one standalone group per rollout node, apart from any other group.

A group lives on a `PrefixStore` of the learner's TCPStore, so a failed group is replaced by one
under a new prefix (a gloo or NCCL group is unusable after one failed operation). Every wait here
has a deadline, and on NCCL a timed-out operation raises instead of letting the watchdog kill the
process: one dead node must not take the learner down.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

ROOT = 0  # learner rank 0 is rank 0 of every node's weight group
POLL_S = 0.0005

_nccl_env_lock = threading.Lock()


def resolve_backend(backend: str, device: torch.device | str) -> str:
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"weights.backend = {backend!r}: allowed 'auto', 'gloo', 'nccl'")
    if backend == "auto":
        return "nccl" if torch.device(device).type == "cuda" else "gloo"
    return backend


@contextlib.contextmanager
def _nccl_errors_raise():
    """NCCL's watchdog kills the process on a timed-out collective by default; for a weight group
    that would let one dead node kill the learner, so this group raises in `wait` instead."""
    with _nccl_env_lock:
        old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        try:
            yield
        finally:
            if old is None:
                del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old


def new_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    device,
    bind_host: str = "",
) -> dist.ProcessGroup:
    """A standalone process group on `PrefixStore(prefix, store)`; blocks until every rank joined
    (gloo) or the communicator is up (NCCL), at most `timeout_s`. `bind_host`: the address gloo
    listens on and gives its peers (else the one this host's name resolves to); NCCL picks its own
    interface (NCCL_SOCKET_IFNAME)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(prefix, store)
    # explicit barrier on the store: NCCL's own bootstrap would wait for a missing peer without a deadline
    prefixed.set(f"joined/{rank}", "1")
    prefixed.wait([f"joined/{r}" for r in range(world_size)], timeout)
    if backend == "gloo":
        if not bind_host:
            return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout, options._devices = timeout, [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    with _nccl_errors_raise():
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    device = torch.device(device)
    if device.index is None:  # "cuda" alone: name the device, as the learner's side ("cuda:0") does
        device = torch.device("cuda", torch.cuda.current_device())
    group.eager_connect_single_device(device)
    return group


def abort(group: dist.ProcessGroup | None) -> None:
    """Free a failed NCCL communicator (a stuck one would block its destructor); gloo needs nothing."""
    fn = getattr(group, "abort", None) if isinstance(group, getattr(dist, "ProcessGroupNCCL", ())) else None
    if fn is not None:
        try:
            fn()
        except Exception:  # already torn down: nothing left to free
            pass


def broadcast_async(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = ROOT, 0
    options.timeout = datetime.timedelta(seconds=timeout_s)
    return group.broadcast([tensor], options)


def wait(work: dist.Work, timeout_s: float) -> None:
    """Block until `work` completes (the calling thread's stream then waits for it too on CUDA)."""
    if work.wait(datetime.timedelta(seconds=timeout_s)) is False:
        raise TimeoutError(f"no completion within {timeout_s:g} s")


def wait_done(works: list[dist.Work], deadline: float) -> None:
    """Poll until every work completed, raising TimeoutError at `deadline` (time.monotonic()).

    Unlike `wait`, polling never makes a CUDA stream wait on an unfinished transfer: the learner's
    training stream must not stall behind a node that is slow to receive.
    """
    for work in works:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("the transfer did not complete before its deadline")
            time.sleep(POLL_S)
        work.wait(datetime.timedelta(seconds=5))  # complete already: surfaces a failed operation's error


def wait_key(store: dist.Store, key: str, deadline: float, poll_s: float = 0.002) -> None:
    """Poll a store key until it exists (raising TimeoutError at `deadline`), without a blocking
    store wait that a dead peer would hold for the store's whole timeout."""
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the peer did not set {key!r} before its deadline")
        time.sleep(poll_s)
