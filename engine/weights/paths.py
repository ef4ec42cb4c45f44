"""Which path a node's weights take, picked from where the node runs (never a user flag), and the error
every path raises.

- `cuda_ipc`: the node runs on learner rank 0's GPU (one GPU shared by both). The learner shares its
  packed push buffers once (CUDA IPC handles); each version the node copies from them on a stream of
  its own. NCCL cannot hold two ranks on one device, so one GPU needs this path.
- `shm`: learner and node on one machine, the learner on CPU: the push buffers live in shared memory
  (memfd) and the node copies from them. Measured against gloo on one host in bench/RESULTS.md.
- `nccl`: a GPU of another device or host (a broadcast over the node's own group).
- `gloo`: a CPU learner and a node on another host.

`weights.backend = "gloo"` or `"nccl"` forces that collective for every node; `"auto"` (the default)
picks per node as above. Every path runs the same protocol: `WeightsReady` → staged → swapped →
`WeightsApplied`, one deadline (`weights.timeout_s`), one eviction.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import socket

COLLECTIVE = ("gloo", "nccl")
SHARED = ("shm", "cuda_ipc")
NAMES = {"cuda_ipc": "CUDA IPC", "shm": "shared memory", "nccl": "NCCL", "gloo": "gloo"}  # as printed


class WeightTransferError(RuntimeError):
    """A transfer that failed or ran past its deadline; names the node (or peer) and the phase."""

    def __init__(self, node_id: str, phase: str, cause: object):
        self.node_id, self.phase, self.cause = node_id, phase, cause
        super().__init__(f"weight transfer with node {node_id!r} failed in phase '{phase}': {cause}")


@dataclasses.dataclass(frozen=True)
class Location:
    """Where a process runs, as far as its weights' path cares: machine and device."""

    host: str
    boot_id: str  # one machine, beyond a hostname containers may share; "" when unknown
    device: str  # "cpu" or "cuda[:i]"
    gpu_uuid: str = ""  # "" on CPU or when unknown

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def same_machine(self, other: Location) -> bool:
        return bool(self.boot_id) and (self.host, self.boot_id) == (other.host, other.boot_id)


def here(device: str) -> Location:
    """This process's location on `device` (the GPU's UUID read from the driver, not its index)."""
    return Location(host=socket.gethostname(), boot_id=boot_id(), device=str(device), gpu_uuid=gpu_uuid(str(device)))


def this_process() -> dict:
    """{pid, host, boot_id}: enough for another process to tell whether this one still runs (the learner writes
    it into RUN/learner.json, which `streamrl status` reads)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id()}


@functools.cache
def boot_id() -> str:
    try:
        return pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def gpu_uuid(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    import torch

    try:
        index = torch.device(device).index
        props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
        return str(props.uuid)
    except (RuntimeError, AssertionError, AttributeError):
        return ""


def choose(learner: Location, node: Location, configured: str = "auto") -> str:
    """The path for a node at `node`, learner rank 0 being at `learner`; `configured` is weights.backend."""
    if configured in COLLECTIVE:
        return configured
    if configured != "auto":
        raise ValueError(f"weights.backend = {configured!r}: allowed 'auto', 'gloo', 'nccl'")
    same = learner.same_machine(node)
    if not learner.on_cuda:
        return "shm" if same else "gloo"
    return "cuda_ipc" if same and learner.gpu_uuid and learner.gpu_uuid == node.gpu_uuid else "nccl"


def planned(configured: str, learner_gpu: int | None, node_gpu: int | None) -> str:
    """The path `choose` will pick for a node `streamrl run` starts on this machine (the placement line)."""
    if configured in COLLECTIVE:
        return configured
    if learner_gpu is None:
        return "shm"
    return "cuda_ipc" if learner_gpu == node_gpu else "nccl"
