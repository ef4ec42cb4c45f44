"""Which GPU each role gets on one host: learner ranks and rollout nodes, explicitly, never shared unless asked.

`plan(cfg, gpus, nodes)` turns `learner.gpus`, `rollout.gpus` and `rollout.share_learner_gpus` into a
`Placement` (learner rank r -> GPU, node i -> GPU), or raises `ConfigError` naming the fields when the
placement cannot be honoured: more ranks than GPUs, a GPU given twice, a GPU this host does not
have, nodes left without a GPU. Empty lists mean automatic: the learner takes the first
`learner.ranks` GPUs and nodes take the rest, round robin. `streamrl run` prints the plan at start.
`node_groups` is how many groups each node runs at once there.
"""

from __future__ import annotations

import dataclasses

from streamrl.engine.config import Config, ConfigError
from streamrl.engine.weights.paths import NAMES, planned


@dataclasses.dataclass(frozen=True)
class Placement:
    learner: list[int]  # GPU of learner rank r
    nodes: list[int]  # GPUs the rollout nodes take, round robin (node i -> nodes[i % len])

    def node_gpu(self, index: int) -> int:
        return self.nodes[index % len(self.nodes)]

    def describe(self, nodes: int, weights_backend: str = "auto") -> str:
        """One line: each role's GPU, and the path each node's weights take (engine/weights/paths.py)."""
        ranks = ", ".join(f"rank {r} → GPU {g}" for r, g in enumerate(self.learner))
        rollout = ", ".join(
            f"node-{i} → GPU {self.node_gpu(i)} ({self._path(i, weights_backend)})" for i in range(nodes)
        )
        return f"placement: learner {ranks}; {rollout or 'no nodes'}"

    def _path(self, index: int, weights_backend: str) -> str:
        path = planned(weights_backend, self.learner[0], self.node_gpu(index))
        shared = "the learner's GPU; " if self.node_gpu(index) in self.learner else ""
        return f"{shared}weights by {NAMES[path]}"


def plan(cfg: Config, gpus: int, nodes: int = 1) -> Placement:
    """The GPUs of a run on a host with `gpus` GPUs and `nodes` rollout nodes (nodes = 0: learner only)."""
    ranks, learner, rollout = cfg.learner.ranks, list(cfg.learner.gpus), list(cfg.rollout.gpus)
    if gpus < 1:
        raise ConfigError("run.device = 'cuda' but this host has no CUDA device (nvidia-smi?); use run.device = 'cpu'")
    _check_listed("learner.gpus", learner, gpus)
    _check_listed("rollout.gpus", rollout, gpus)
    if not learner:
        if ranks > gpus:
            raise ConfigError(f"learner.ranks = {ranks} but this host has {gpus} GPU(s); one rank per GPU")
        learner = list(range(ranks))
    elif len(learner) != ranks:
        raise ConfigError(f"learner.gpus = {learner} lists {len(learner)} GPU(s) for learner.ranks = {ranks}; "
                          "give one GPU per rank")  # fmt: skip
    shared = sorted(set(learner) & set(rollout))
    if shared and not cfg.rollout.share_learner_gpus:
        raise ConfigError(f"GPU(s) {shared} are in both learner.gpus and rollout.gpus; give each role its own, "
                          "or set rollout.share_learner_gpus = true")  # fmt: skip
    if not rollout:
        rollout = [g for g in range(gpus) if g not in learner]
    if not rollout and nodes:
        if not cfg.rollout.share_learner_gpus:
            raise ConfigError(f"the learner takes every GPU of this host ({gpus}); rollout nodes have none left: "
                              "lower learner.ranks, or set rollout.share_learner_gpus = true")  # fmt: skip
        rollout = learner
    return Placement(learner=learner, nodes=rollout)


def _check_listed(field: str, listed: list[int], gpus: int) -> None:
    if len(set(listed)) != len(listed):
        raise ConfigError(f"{field} = {listed} gives a GPU twice; each GPU once")
    missing = [g for g in listed if not 0 <= g < gpus]
    if missing:
        raise ConfigError(f"{field} = {listed}: this host has GPUs 0..{gpus - 1}, not {missing}")


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


HF_GPU_ROWS = 256  # the hf backend's static cache is fastest at this many rows on CUDA (engine/memory.MAX_BATCH)
CPU_GROUPS = 8


def admitted_groups(cfg: Config) -> int:
    """The most groups the ledger lets every node together hold at once (its admission capacity)."""
    return cfg.ledger.admitted_groups(cfg.learner.groups_per_step, cfg.run.mode)


def shared_groups(cfg: Config, peers: int) -> int:
    """The groups each of `peers` vLLM nodes on one GPU runs at once when `rollout.max_concurrent_groups` is left
    to the engine: an equal share of what the ledger admits, not all of it each (every engine's KV cache sized
    for all of them, and the first node up taking them all while the others wait); 0 where it does not apply.
    Several engines on one GPU are worth it where one engine's host work is the limit (bench/vllm_host_cost.py:
    two engines 1.9x one)."""
    if cfg.rollout.backend != "vllm" or cfg.rollout.max_concurrent_groups or peers < 2:
        return 0
    return -(-admitted_groups(cfg) // peers)


def shared_gpu_share(cfg: Config, placement: Placement, nodes: int, index: int) -> list[str]:
    """The `--set` that launched node `index` of `nodes` takes for its `shared_groups` (none when alone)."""
    gpu = placement.node_gpu(index)
    share = shared_groups(cfg, sum(1 for i in range(max(nodes, index + 1)) if placement.node_gpu(i) == gpu))
    return ["--set", f"rollout.max_concurrent_groups={share}"] if share else []


def node_groups(cfg: Config, device: str) -> int:
    """Groups one node generates at once: `rollout.max_concurrent_groups`, or with 0 the engine's choice.

    On a GPU vLLM batches continuously, so it takes every group the credits admit (more running sequences,
    more tokens a step; its KV cache is sized for them); the hf backend fills its static cache's rows. On
    CPU 8, where a bigger batch only slows each token."""
    if cfg.rollout.max_concurrent_groups:
        return cfg.rollout.max_concurrent_groups
    if not device.startswith("cuda"):
        return CPU_GROUPS
    if cfg.rollout.backend == "vllm":
        return admitted_groups(cfg)
    return max(1, HF_GPU_ROWS // cfg.rollout.group_size)
