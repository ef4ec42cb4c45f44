"""Run under torchrun: train, save a checkpoint, or resume one, on any number of ranks.

usage: torchrun --nproc_per_node N checkpoint_reshard_worker.py MODEL_DIR RUN_DIR save|resume OUT_FILE
  save:   two steps, checkpoint at step 2, one more step
  resume: load RUN_DIR's latest checkpoint, one more step
Rank 0 writes {"loaded"|"saved": (weights, optimizer state) at step 2, "after": weights after step 3}.
"""

import random
import sys

import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner import checkpoint, parallel
from streamrl.learner.batching import pack
from streamrl.learner.train_step import Trainer

CFG = LearnerConfig(lr=1e-2, max_grad_norm=1.0)


def batch(step: int, rank: int, world: int):
    """The step's 8 samples (the same for any world size), dealt to the ranks; the global token count."""
    rng = random.Random(step)
    trajs = []
    for i in range(8):
        completion = [rng.randrange(3, 500) for _ in range(rng.randint(2, 8))]
        trajs.append(
            Trajectory(
                sample_id=f"s{step}-{i}",
                group_id=f"g{i // 4}",
                node_id="n",
                seq=i,
                prompt_ids=[rng.randrange(3, 500) for _ in range(rng.randint(2, 6))],
                completion_ids=completion,
                behavior_logprobs=[-6.0] * len(completion),
                reward=0.0,
                policy_version=0,
            )
        )
    advantages = [rng.uniform(-1.5, 1.5) for _ in trajs]
    tokens = sum(len(t.completion_ids) for t in trajs)
    return pack(trajs[rank::world], advantages[rank::world], token_budget=32), tokens


def snapshot(trainer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # clones: on one rank the gathered tensors can alias the live parameters, which the next step moves
    weights = {k: v.clone() for k, v in parallel.full_state_dict(trainer.model).items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    optim = get_optimizer_state_dict(trainer.model.lm, trainer.optimizer, options=options)
    flat = {f"{n}.{k}": v.clone() for n, st in optim.get("state", {}).items() for k, v in st.items()}
    return weights, flat


def main(model_dir: str, run_dir: str, mode: str, out_file: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    device = parallel.init_distributed(timeout_s=120)
    try:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        trainer = Trainer(parallel.wrap_model(lm, CFG, device), LossConfig(), CFG, device)
        out = {}
        if mode == "save":
            for step in (1, 2):
                trainer.step(*batch(step, rank, world))
            state = checkpoint.LearnerState(step=2, version=trainer.version)
            checkpoint.save(
                checkpoint.checkpoints_dir(run_dir), lm, trainer.optimizer, trainer.scheduler, state, model_dir
            )
            out["saved"] = snapshot(trainer)
        else:
            state = checkpoint.load(checkpoint.resolve("latest", run_dir), lm, trainer.optimizer, trainer.scheduler)
            trainer.load_state_dict(state.trainer_state())
            out["loaded"] = snapshot(trainer)
            out["state"] = (state.step, state.version, state.world_size)
        trainer.step(*batch(3, rank, world))
        out["after"] = parallel.full_state_dict(trainer.model)
        if rank == 0:
            torch.save(out, out_file)
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])
