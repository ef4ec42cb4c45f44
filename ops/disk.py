"""What a run will write to its folder, estimated before it starts (preflight warns when the folder's disk
has less room: `need`, `check`). Each part from measured rates:

- the ledger (the embedded Redis's append-only file): ~2.2 KB a sample as it grows (the demo: 8.3 MB for
  3,840 samples), ~240 B a sample once Redis rewrites it (906 KB for the same run), which it does past
  64 MiB and twice its last rewrite: it never holds more than the smaller of the two bounds below;
- logs, metrics and events: ~3.4 KB a step on the demo (2 nodes);
- checkpoints: `checkpoint.keep_last` + 1 of them (the newest is written before the oldest goes), and each
  `keep_every`-th, of `checkpoint_bytes` each, the learner's own estimate (within 2x of `du`);
- exports: the weights in `model.dtype` and the HF files, every `export_every` steps.
"""

from __future__ import annotations

import pathlib
import shutil

from streamrl.engine.config import Config

LEDGER_GROWTH = 2560  # bytes a sample adds to the append-only file (2.2 KB measured, with some margin)
LEDGER_KEPT = 256  # bytes a sample takes once the file is rewritten (240 measured)
REWRITE_MIN = 64 << 20  # Redis rewrites no file smaller than this (auto-aof-rewrite-min-size)
LOG_BYTES_PER_STEP = 6 << 10  # logs, metrics.jsonl and events.jsonl (3.4 KB measured, TensorBoard on top)


def ledger_bytes(samples: int) -> int:
    """The append-only file's largest size over a run of `samples`: it grows until Redis rewrites it, then
    holds the rewrite plus what came since (at most the rewrite again)."""
    return min(samples * LEDGER_GROWTH, max(REWRITE_MIN, 2 * samples * LEDGER_KEPT) + samples * LEDGER_KEPT)


def need(cfg: Config, hf_config, model_source: str) -> dict[str, int]:
    """Bytes each part of the run folder will take at most (the module note)."""
    from streamrl.learner.checkpoint.layout import checkpoint_bytes, estimate_bytes, hf_files_bytes

    steps, ck = cfg.run.steps, cfg.checkpoint
    samples = steps * cfg.learner.groups_per_step * cfg.rollout.group_size
    ranks = max(1, cfg.learner.ranks)
    weights, model, files = _meta_model(hf_config), cfg.model.dtype, hf_files_bytes(model_source)
    if cfg.lora.enabled:
        from streamrl.engine import memory

        shape = memory.shape_of(hf_config)
        adapters = 4 * memory.adapter_params(cfg, shape)  # fp32 adapters, 2 tensors per target, 7 targets a layer
        one = checkpoint_bytes(adapters, adapters, 4 * 2 * 7 * shape.layers, files, ranks)
    else:
        one = estimate_bytes(weights, model_source, ranks)
    saves = 0 if not (ck.every or ck.budget) else ck.keep_last + 1 + (steps // ck.keep_every if ck.keep_every else 0)
    exported = sum(p.numel() for p in weights.parameters()) * (2 if model in ("bfloat16", "float16") else 4) + files
    return {
        "ledger": 0 if cfg.ledger.url else ledger_bytes(samples),
        "logs": steps * LOG_BYTES_PER_STEP,
        "checkpoints": saves * one,
        "exports": (steps // ck.export_every) * exported if ck.export_every else 0,
    }


def check(cfg: Config, hf_config, model_source: str) -> str:
    """'' when the run folder's disk has room for what the run will write, else the warning's one line."""
    parts = need(cfg, hf_config, model_source)
    folder = pathlib.Path(cfg.run.path)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free >= sum(parts.values()):
        return ""
    mib = lambda n: f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"  # noqa: E731
    said = ", ".join(f"{part} {mib(n)}" for part, n in parts.items() if n)
    return (
        f"the disk of {folder} has {mib(free)} free; this run will write about {mib(sum(parts.values()))} to "
        f"{cfg.run.path} ({said}): free space, point run.dir elsewhere, or lower run.steps or "
        "checkpoint.keep_last; a full disk stops the run (its ledger cannot write) and skips checkpoints"
    )


def _meta_model(hf_config):
    """The architecture on the meta device (no memory, no weights read), in fp32 as the learner trains it."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
