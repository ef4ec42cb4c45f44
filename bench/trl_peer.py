"""The peer run: TRL's GRPOTrainer on streamrl's config, same model, prompts, reward and step shape.

    python -m streamrl.bench.trl_peer --config examples/gpu.toml --model models/qwen2-0.5b-shape --steps 50 \
        --vllm-colocate --out trl.jsonl        # one GPU, TRL generating with vLLM in its own process (colocate)
    python -m streamrl.bench.trl_peer --steps 2  # CPU: the demo's config and tiny model, TRL's own generation

Read from the streamrl config, so both runs train the same thing: the model folder, the demo prompts (or
`data.path`'s jsonl), the reward functions by the same names (TRL calls them with its own signature, which
streamrl's rewards take), `rollout.group_size` completions a prompt, `rollout.max_tokens`, `rollout.temperature`,
`learner.lr`, `learner.groups_per_step` prompts an optimizer step, no KL term (streamrl's default). Prints one JSON
line a step (`trl_step`: wall time, mean reward, completion tokens) and one for the run (`trl_run`: trained
completion tokens/s and steps/s over the steps after the first, peak GPU memory), to stdout and `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def _rows(cfg) -> list[dict]:
    if not cfg.data.path:
        from streamrl.rewards.demo import demo_rows
        from streamrl.rollout.sources import DEMO_ROWS

        return demo_rows(DEMO_ROWS, cfg.run.seed)
    with open(cfg.data.path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _dataset(rows: list[dict]):
    """A datasets.Dataset built without its fingerprinting (dill cannot pickle pyarrow 26's types; FINDINGS)."""
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable(pa.Table.from_pylist(rows)), fingerprint="streamrl-trl-peer")


def _rewards(cfg) -> list:
    from streamrl.rewards import resolve

    return [resolve(name, cfg.reward) for name in cfg.reward.functions]


def _peak_gib() -> float | None:
    """torch's peak allocation in this process so far (TRL's model, optimizer and, colocated, vLLM's share)."""
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


class _Steps:
    """A TrainerCallback's log hook: one line a step, and the run's totals."""

    def __init__(self, completions: int, out):
        self.completions, self.out, self.lines = completions, out, []
        self.start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "reward" not in logs:
            return
        length = logs.get("completions/mean_length", 0.0)
        line = {
            "figure": "trl_step",
            "step": state.global_step,
            "wall_s": round(time.perf_counter() - self.start, 3),
            "reward_mean": logs["reward"],
            "completion_tokens": round(length * self.completions),
            "peak_gib": _peak_gib(),
        }  # the peak on every step: a run cut at its limit still has one
        self.lines.append(line)
        self.out(line)


def _config(args, cfg, folder: str):
    import torch
    from trl import GRPOConfig

    completions = cfg.learner.groups_per_step * cfg.rollout.group_size
    accumulate = args.micro_batches
    if completions % accumulate:
        raise SystemExit(f"--micro-batches {accumulate} must divide the step's {completions} completions")
    extra = {}
    if args.vllm_colocate:
        extra = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=args.vllm_memory,
            vllm_max_model_length=cfg.model.max_model_len,
        )  # as streamrl's engine (else the model's 32k)
    return GRPOConfig(
        output_dir=folder,
        max_steps=args.steps,
        per_device_train_batch_size=completions // accumulate,
        gradient_accumulation_steps=accumulate,
        num_generations=cfg.rollout.group_size,
        max_completion_length=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature,
        learning_rate=cfg.learner.lr,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=cfg.run.seed,
        bf16=torch.cuda.is_available() and cfg.model.dtype == "bfloat16",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        **extra,
    )


def run(args) -> dict:
    from trl import GRPOTrainer

    from streamrl.engine.config import load
    from streamrl.engine.models import default_tiny_model
    from streamrl.ops.run import DEMO

    cfg = load(args.config or None, [] if args.config else [*DEMO, "learner.groups_per_step=4", *args.set])
    model = args.model or cfg.model.path or str(default_tiny_model())
    if args.vllm_colocate:  # colocate mode joins a one-process distributed group (FINDINGS: TRL beside vLLM)
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(args.port))
    completions = cfg.learner.groups_per_step * cfg.rollout.group_size

    def emit(line: dict) -> None:
        print(json.dumps(line), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")

    steps = _Steps(completions, emit)
    with tempfile.TemporaryDirectory() as folder:
        from transformers import TrainerCallback

        callback = type("StepLines", (TrainerCallback,), {"on_log": steps.on_log})()
        trainer = GRPOTrainer(model=model, reward_funcs=_rewards(cfg), args=_config(args, cfg, folder),
                              train_dataset=_dataset(_rows(cfg)), callbacks=[callback])  # fmt: skip
        steps.start = time.perf_counter()
        trainer.train()
    timed = steps.lines[1:] or steps.lines
    seconds = (timed[-1]["wall_s"] - steps.lines[0]["wall_s"]) if len(steps.lines) > 1 else steps.lines[0]["wall_s"]
    tokens = sum(line["completion_tokens"] for line in timed)
    summary = {
        "figure": "trl_run",
        "steps": len(steps.lines),
        "trained_tok_s": round(tokens / seconds, 1) if seconds else None,
        "steps_per_s": round(len(timed) / seconds, 4) if seconds else None,
        "reward_first": steps.lines[0]["reward_mean"],
        "reward_last": steps.lines[-1]["reward_mean"],
        "peak_gib": _peak_gib(),
        "model": model,
        "vllm": bool(args.vllm_colocate),
        "completions_per_step": completions,
    }
    emit(summary)
    return summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="", help="streamrl's config (default: the demo's)")
    parser.add_argument("--set", action="append", default=[], help="config override (with the demo's config)")
    parser.add_argument("--model", default="", help="model folder (default: the config's)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation over the step's samples")
    parser.add_argument("--vllm-colocate", action="store_true", help="generate with vLLM in TRL's process")
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's GPU share in colocate mode")
    parser.add_argument("--port", type=int, default=29517, help="MASTER_PORT for colocate mode")
    parser.add_argument("--out", default="", help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        sys.exit("--steps must be >= 1")
    run(args)


if __name__ == "__main__":
    main()
