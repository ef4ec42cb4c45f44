"""Preflight's GPU check (ops/preflight.py runs it): the placement `streamrl run` plans can be honoured, and on a
GPU shared by the learner and rollout nodes both shares fit its memory (engine/memory.py estimates)."""

from __future__ import annotations

from streamrl.engine.config import Config
from streamrl.ops.preflight import ROLES, Problem, _Context, _problem


def check_gpu_placement(ctx: _Context) -> list[Problem]:
    """`streamrl run` on GPUs: the placement can be honoured, and on a GPU shared by the learner and
    rollout nodes (rollout.share_learner_gpus) both shares fit its memory (engine/memory.py estimates)."""
    from streamrl.engine import memory
    from streamrl.engine.config import ConfigError
    from streamrl.engine.placement import plan, visible_gpus

    cfg = ctx.cfg
    gpus = visible_gpus() if cfg.run.device in ("auto", "cuda") else 0
    if set(ROLES) - ctx.roles or ctx.hf_config is None or (not gpus and cfg.run.device != "cuda"):
        return []  # run.device = 'cuda' on a host without one is planned, and so refused, here
    try:
        placement = plan(cfg, gpus, ctx.nodes)
    except ConfigError as e:
        return [_problem("gpu", str(e))]
    shape, out, modes = memory.shape_of(ctx.hf_config), [], set()
    for gpu in sorted(set(placement.learner)):
        nodes = [f"node-{i}" for i in range(ctx.nodes) if placement.node_gpu(i) == gpu]
        if nodes:
            shared = memory.shared_gpu(cfg, shape, len(nodes), memory.device_gib(gpu))
            out.append(_shared_gpu(cfg, shape, gpu, nodes, shared))
            modes.add(shared.pick(cfg.run.mode))
    if cfg.run.mode == "auto" and modes:
        ctx.mode = "sync" if "sync" in modes else "async"
    return out


def _shared_gpu(cfg: Config, shape, gpu: int, nodes: list[str], shared) -> Problem:
    """One GPU shared by learner rank and `nodes` (`memory.SharedGpu`): an error naming the fields and the
    numbers when the mode run.mode gives cannot fit its memory, else an info line with the split (and with
    run.mode = 'auto', the mode it comes to and why)."""
    from streamrl.engine import memory

    mode, total, who = shared.pick(cfg.run.mode), shared.total, ", ".join(nodes)
    need = shared.sync_gib if mode == "sync" else shared.async_gib
    split = f"learner {shared.learner}; {len(nodes)} x node {shared.node}"
    asleep = "the nodes asleep (KV cache released) while the learner trains"
    if shared.fits(mode):
        why = f"run.mode = '{mode}' with {asleep}" if mode == "sync" else f"run.mode = '{mode}'"
        if cfg.run.mode == "auto" and mode == "sync":
            why = f"run.mode = 'auto' → 'sync': async would need ≈ {shared.async_gib:.1f} GiB; sync with {asleep}"
        elif cfg.run.mode == "auto":
            why = "run.mode = 'auto' → 'async': both resident"
        return _problem("gpu", f"GPU {gpu} shared by the learner and {who}, {why}: {need:.1f} of {total:.1f} GiB "
                        f"({split})", level="info")  # fmt: skip
    fits = memory.largest_tokens(cfg, shape, total - len(nodes) * shared.node.gib)
    fixes = [f"learner.micro_batch_tokens = {fits}" if fits else "",
             "" if cfg.learner.activation_checkpointing else "learner.activation_checkpointing = true",
             "a smaller rollout.gpu_memory_gib" if cfg.rollout.gpu_memory_gib else "",
             f"run.mode = 'sync' ({asleep}: ≈ {shared.sync_gib:.1f} GiB)" if shared.fits("sync") else "",
             "a GPU of their own for the nodes (rollout.gpus)"]  # fmt: skip
    need = min(shared.async_gib, shared.sync_gib) if cfg.run.mode == "auto" else need
    modes = "run.mode = 'sync' and 'async' both keep the learner and the nodes resident"
    if cfg.rollout.backend == "vllm":
        modes = f"async keeps both resident, ≈ {shared.async_gib:.1f}; sync with {asleep}, ≈ {shared.sync_gib:.1f}"
    return _problem(
        "gpu",
        f"GPU {gpu} has {total:.1f} GiB but the learner and {who} sharing it need ≈ {need:.1f} GiB ({modes}; "
        f"{split}), so run.mode = '{cfg.run.mode}' cannot fit. Fix: {' or '.join(f for f in fixes if f)}",
    )
