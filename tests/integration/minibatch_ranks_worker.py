"""Run under torchrun on 2 ranks: for each count in UPDATES (comma-separated), one learner step of that many
updates with a reference KL, from the same fresh model; rank 0 saves every rank's metrics per count (one
launch for all the counts: a torchrun start is most of a test's time).

usage: torchrun --nproc_per_node 2 minibatch_ranks_worker.py MODEL_DIR OUT_FILE UPDATES
The batch is fsdp_parity_worker's, shared unequally on purpose: rank 0 gets its first 6 samples (two
micro-batches of 32 positions), rank 1 the last 2 (one micro-batch), sent as the learner loop sends them
(`step_scatter.scatter_step`). With 2 updates rank 0 deals out whole micro-batches and rank 1 slices its one;
with 3, rank 0 slices too and rank 1 has one mini-batch with no sample. The step must still run the same
collectives on both ranks.
"""

import sys

import torch
from fsdp_parity_worker import fixed_batch

from streamrl.engine.config import build
from streamrl.learner import parallel, step_scatter
from streamrl.learner.batching import StepBatch, pack
from streamrl.learner.reference import build_reference
from streamrl.learner.train_step import Trainer


def main(model_dir: str, out_file: str, counts: str) -> None:
    device = parallel.init_distributed(timeout_s=120)
    try:
        saved = {int(updates): step(model_dir, device, int(updates)) for updates in counts.split(",")}
        if parallel.is_rank0():
            torch.save(saved, out_file)
    finally:
        parallel.shutdown()


def step(model_dir: str, device: torch.device, updates: int) -> dict:
    """One step of `updates` updates on a fresh model: every rank's metrics and the version after it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = build(
        {
            "model": {"path": model_dir},
            "loss": {"kl_coef": 0.1},
            "learner": {"lr": 5e-2, "mini_batches": updates, "micro_batch_tokens": 32},
        }
    )
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    policy = parallel.wrap_model(lm, cfg.learner, device)
    reference = build_reference(cfg, device, torch.float32, policy)
    trainer = Trainer(policy, cfg.loss, cfg.learner, device, ref_model=reference)
    trajs, advantages = fixed_batch()
    per_rank = None
    if parallel.is_rank0():
        shares = [pack(trajs[:6], advantages[:6], 32), pack(trajs[6:], advantages[6:], 32)]
        loss_tokens = sum(len(t.completion_ids) for t in trajs)
        per_rank = [StepBatch(mbs, 0, loss_tokens) for mbs in shares]
    mine = step_scatter.scatter_step(per_rank, device).micro_batches
    metrics = trainer.step(mine)
    everyone = parallel.gather_objects({"metrics": metrics, "micro_batches": len(mine)})
    return {"ranks": everyone, "version": trainer.version}


if __name__ == "__main__":
    main(*sys.argv[1:4])
