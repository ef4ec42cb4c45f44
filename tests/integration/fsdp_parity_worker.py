"""Run under torchrun: two learner steps on a fixed batch, rank 0 saves loss, metrics and weights.

usage: torchrun --nproc_per_node N fsdp_parity_worker.py MODEL_DIR OUT_FILE [FSDP_UNIT_PARAMS]
Rank 0 splits the batch between the ranks by tokens and sends each its micro-batches as tensors
(`step_scatter.scatter_step`), as the learner loop does; a rank with fewer micro-batches runs fillers.
"""

import random
import sys

import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner import parallel, step_scatter
from streamrl.learner.batching import StepBatch, pack, pack_for_ranks, sequence_cost
from streamrl.learner.train_step import Trainer


def fixed_batch() -> tuple[list[Trajectory], list[float]]:
    rng = random.Random(1234)
    trajs, advantages = [], []
    for i in range(8):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(2, 9))]
        completion = [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))]
        trajs.append(
            Trajectory(
                sample_id=f"s{i}",
                group_id=f"g{i // 4}",
                node_id="n",
                seq=i,
                prompt_ids=prompt,
                completion_ids=completion,
                reward=0.0,
                policy_version=0,
                behavior_logprobs=[-6.2 + rng.uniform(-0.3, 0.3) for _ in completion],
            )
        )
        advantages.append(rng.uniform(-1.5, 1.5))
    return trajs, advantages


def main(model_dir: str, out_file: str, unit_params: str = "") -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    device = parallel.init_distributed(timeout_s=120)
    try:
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        cfg = LearnerConfig(lr=1e-3, max_grad_norm=1.0, fsdp_unit_params=int(unit_params or 10**9))
        trainer = Trainer(parallel.wrap_model(lm, cfg, device), LossConfig(aggregation="sequence"), cfg, device)
        trajs, advantages = fixed_batch()
        micro_batches = pack(trajs, advantages, token_budget=32)
        per_rank = None
        if parallel.is_rank0():
            shares = pack_for_ranks(trajs, advantages, parallel.world_size(), token_budget=32)
            loss_tokens = sum(len(t.completion_ids) for t in trajs)
            per_rank = [StepBatch(mbs, 0, loss_tokens) for mbs in shares]
        batch = step_scatter.scatter_step(per_rank, device)
        mine = batch.micro_batches
        metrics = [trainer.step(mine), trainer.step(mine)]
        positions = parallel.gather_objects(sum(mb.num_tokens for mb in mine))
        state = parallel.full_state_dict(trainer.model)
        if parallel.is_rank0():
            units = [m for m in trainer.model.modules() if isinstance(m, torch.distributed.fsdp.FSDPModule)]
            torch.save(
                {
                    "metrics": metrics,
                    "state": state,
                    "micro_batches": len(micro_batches),
                    "fsdp_units": len(units),
                    "rank_positions": positions,
                    "largest_sample": max(sequence_cost(t) for t in trajs),
                },
                out_file,
            )
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
