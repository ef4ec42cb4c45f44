"""Run inside a small disk (tests/conftest.py `small_disk`) by test_checkpoint_disk.py: a Keeper saving every
step on a disk with room for two checkpoints, then one save forced past the room check. What happened goes to
OUT/checkpoints.json.

    python checkpoint_disk_worker.py OUT DISK MODEL_DIR
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import sys

import torch


def main() -> None:
    out, disk, model_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    from transformers import AutoModelForCausalLM

    from streamrl.engine.config import CheckpointConfig, LearnerConfig, LossConfig
    from streamrl.learner import checkpoint, parallel
    from streamrl.learner.checkpoint import store
    from streamrl.learner.train_step import Trainer

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("streamrl").addHandler(handler)
    device = parallel.init_distributed()
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    cfg = LearnerConfig(lr=1e-2)
    trainer = Trainer(parallel.wrap_model(lm, cfg, device), LossConfig(), cfg, device)
    keeper = checkpoint.Keeper(CheckpointConfig(every=1, keep_last=2), disk / "run", trainer.model.lm, trainer,
                               model_dir, last_step=5)  # fmt: skip
    record: dict = {"need": keeper.need, "steps": {}}
    for step in range(1, 6):
        try:
            keeper.after_step(step, trainer.model)
            record["steps"][step] = "saved" if (keeper.root / f"step_{step}").is_dir() else "skipped"
        except checkpoint.DiskFullError as e:
            record["steps"][step] = f"error: {e}"
    record["warnings"] = list(warnings)
    # past the room check (as if the disk filled between the check and the write): ENOSPC inside DCP's write
    store.check_writable = lambda root, need: None
    free_before = shutil.disk_usage(disk).free
    try:
        keeper._save(6)
        record["forced"] = "saved"
    except checkpoint.DiskFullError as e:
        record["forced"] = f"error: {e}"
    record["forced_warning"] = warnings[-1] if len(warnings) > len(record["warnings"]) else ""
    record["left_behind"] = sorted(p.name for p in keeper.root.iterdir())
    record["free_before"], record["free_after"] = free_before, shutil.disk_usage(disk).free
    (out / "checkpoints.json").write_text(json.dumps(record))
    parallel.shutdown()


if __name__ == "__main__":
    main()
