"""Checkpoint cost on one learner rank: DCP save, resume, HF export, against a plain `torch.save`
(fsync'd) of the same model + optimizer state measured in this run; one JSON line per figure.
The checkpoint holds a tied embedding twice (DCP saves each name), hence its larger size.

The models are Qwen2 bodies with random init: the built-in tiny one, and with `--models tiny,40M`
a ~40M one. The AdamW state is filled by one real training step on a short batch.

    python -m streamrl.bench.checkpoint [--models tiny,40M] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import tempfile
import time

import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.engine.models import SHAPES, tiny_config
from streamrl.learner import checkpoint, parallel
from streamrl.learner.batching import pack
from streamrl.learner.train_step import Trainer
from streamrl.ops.export import export_checkpoint

MODELS = {"tiny": dict(vocab_size=512), "40M": dict(vocab_size=32000, **SHAPES["medium-kv4"])}


def trained_trainer(name: str) -> Trainer:
    from transformers import AutoModelForCausalLM

    fields = dict(MODELS[name])
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny_config(fields.pop("vocab_size"), **fields), dtype=torch.float32)
    cfg = LearnerConfig(lr=1e-3)
    trainer = Trainer(parallel.wrap_model(lm, cfg, torch.device("cpu")), LossConfig(), cfg, torch.device("cpu"))
    trajs = [
        Trajectory(
            sample_id=f"s{i}",
            group_id="g",
            node_id="n",
            seq=i,
            prompt_ids=[3, 4, 5],
            completion_ids=[6, 7],
            behavior_logprobs=[-6.0, -6.0],
            reward=0.0,
            policy_version=0,
        )
        for i in range(2)
    ]
    trainer.step(pack(trajs, [1.0, -1.0], token_budget=16))
    return trainer


def folder_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(name: str, repeats: int, work: pathlib.Path) -> list[dict]:
    trainer = trained_trainer(name)
    lm, params = trainer.model.lm, sum(p.numel() for p in trainer.model.lm.parameters())
    base, save, load, export = [], [], [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(lm, trainer.optimizer)
        with open(work / f"plain-{i}.pt", "wb") as f:  # durable like the checkpoint: fsync'd
            torch.save({"model": model_sd, "optim": optim_sd}, f)
            f.flush()
            os.fsync(f.fileno())
        base.append(time.perf_counter() - t0)
        state = checkpoint.LearnerState(step=i + 1, version=trainer.version)
        t0 = time.perf_counter()
        path = checkpoint.save(work / "checkpoints", lm, trainer.optimizer, trainer.scheduler, state, keep_last=1)
        save.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checkpoint.load(path, lm, trainer.optimizer, trainer.scheduler)
        load.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        export_checkpoint(path, work / "export", overwrite=True)
        export.append(time.perf_counter() - t0)
    ckpt_bytes = folder_bytes(path)
    plain_bytes = (work / "plain-0.pt").stat().st_size
    common = {"model": name, "params": params, "repeats": repeats}
    return [
        {
            **common,
            "figure": "save_s",
            "value": min(save),
            "baseline_torch_save_s": min(base),
            "ratio": min(save) / min(base),
        },
        {**common, "figure": "resume_s", "value": min(load)},
        {**common, "figure": "export_s", "value": min(export)},
        {
            **common,
            "figure": "checkpoint_bytes",
            "value": ckpt_bytes,
            "baseline_torch_save_bytes": plain_bytes,
            "ratio": ckpt_bytes / plain_bytes,
        },
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    parallel.init_distributed()
    try:
        for name in args.models.split(","):
            work = pathlib.Path(tempfile.mkdtemp(prefix="streamrl-bench-ckpt-"))
            try:
                for line in measure(name, args.repeats, work):
                    print(json.dumps(line), flush=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
