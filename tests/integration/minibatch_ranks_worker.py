"""Run under torchrun on 2 ranks: for each count in UPDATES (comma-separated), one learner step of that many
updates with a reference KL, from the same fresh model; rank 0 saves every rank's metrics per count (one
launch for all the counts: a torchrun start is most of a test's time).

usage: torchrun --nproc_per_node 2 minibatch_ranks_worker.py MODEL_DIR OUT_FILE UPDATES
The batch is fsdp_parity_worker's, shared unequally on purpose: rank 0 gets its first 6 samples (two
micro-batches of 32 positions), rank 1 the last 2 (one micro-batch), sent as the learner loop sends them
(`step_scatter.scatter_step`). With 2 updates rank 0 deals out whole micro-batches and rank 1 slices its one;
with 3, rank 0 slices too and rank 1 has one mini-batch with no sample. The step must still run the same
collectives on both ranks. Then, under "ppo", one step of `loss.preset = "ppo"` with an adaptive KL in the
reward on the same shares: the critic's collectives, and the KL coefficient each rank holds after it. Under
"lora", a LoRA step of 2 updates with a reference KL, its reference the policy's own base (adapters off), read
against a reference built from MODEL_DIR after the step.
"""

import sys

import torch
from fsdp_parity_worker import fixed_batch

from streamrl.engine.config import build
from streamrl.learner import parallel, step_scatter
from streamrl.learner.batching import StepBatch, pack
from streamrl.learner.critic.trainer import build_shaper
from streamrl.learner.main import _policy
from streamrl.learner.reference import build_reference, release
from streamrl.learner.train_step import Trainer


def main(model_dir: str, out_file: str, counts: str) -> None:
    device = parallel.init_distributed(timeout_s=120)
    try:
        saved = {int(updates): step(model_dir, device, int(updates)) for updates in counts.split(",")}
        saved["ppo"] = ppo_step(model_dir, device)
        saved["lora"] = lora_step(model_dir, device)
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
    mine = my_share(device)
    metrics = trainer.step(mine)
    everyone = parallel.gather_objects({"metrics": metrics, "micro_batches": len(mine)})
    return {"ranks": everyone, "version": trainer.version}


def my_share(device: torch.device) -> list:
    """This rank's micro-batches of fixed_batch: rank 0 its first 6 samples, rank 1 the last 2."""
    trajs, advantages = fixed_batch()
    per_rank = None
    if parallel.is_rank0():
        shares = [pack(trajs[:6], advantages[:6], 32), pack(trajs[6:], advantages[6:], 32)]
        loss_tokens = sum(len(t.completion_ids) for t in trajs)
        per_rank = [StepBatch(mbs, 0, loss_tokens) for mbs in shares]
    return step_scatter.scatter_step(per_rank, device).micro_batches


def ppo_step(model_dir: str, device: torch.device) -> list[dict]:
    """One PPO step (a critic, GAE) with an adaptive KL in the reward: every rank's metrics and its beta after."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = build(
        {
            "model": {"path": model_dir},
            "loss": {"preset": "ppo"},
            "rollout": {"group_size": 1},
            "critic": {"kl_in_reward": 0.05, "kl_ctrl": "adaptive", "kl_target": 0.01, "kl_horizon": 40},
            "learner": {"lr": 1e-3, "micro_batch_tokens": 32},
        }
    )
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    policy = parallel.wrap_model(lm, cfg.learner, device)
    reference = build_reference(cfg, device, torch.float32, policy)
    shaper = build_shaper(cfg, device, torch.float32, reference)
    trainer = Trainer(policy, cfg.loss, cfg.learner, device, ref_model=reference, shaper=shaper)
    metrics = trainer.step(my_share(device))
    return parallel.gather_objects({"metrics": metrics, "kl_coef": shaper.kl_ctrl.value})


def lora_step(model_dir: str, device: torch.device) -> list[dict]:
    """One LoRA step of 2 updates with loss.kl_coef, the reference being the policy's base with its adapters off:
    every rank's metrics and its reference's type, then, on the whole batch (every rank the same forwards), the
    largest gap from a reference built from model_dir of that base's logprobs and of the policy's."""
    torch.manual_seed(0)
    lora = {"lora": {"enabled": True, "rank": 8, "alpha": 16.0}, "rollout": {"temperature": 0.7}}
    learner = {"lr": 5e-2, "mini_batches": 2, "micro_batch_tokens": 32}
    cfg = build({"model": {"path": model_dir}, "loss": {"kl_coef": 0.1}, "learner": learner, **lora})
    policy, _, compute, _ = _policy(cfg, device)
    reference = build_reference(cfg, device, compute, policy)
    own_cfg = build({"model": {"path": model_dir}, "loss": {"kl_coef": 0.1, "reference_path": model_dir}, **lora})
    own = build_reference(own_cfg, device, compute, policy)
    trainer = Trainer(policy, cfg.loss, cfg.learner, device, ref_model=reference)
    metrics = trainer.step(my_share(device))
    base_gap = policy_gap = 0.0
    with torch.no_grad():
        for mb in pack(*fixed_batch(), 32):
            inputs = (mb := mb.to(device)).input_ids, mb.position_ids, mb.targets, mb.cu_seqlens, mb.max_seqlen
            expected = own(*inputs)[0]
            base_gap = max(base_gap, float((reference(*inputs)[0] - expected).abs().max()))
            policy_gap = max(policy_gap, float((policy(*inputs)[0] - expected).abs().max()))
    release(own)
    mine = {"metrics": metrics, "reference": type(reference).__name__, "base_gap": base_gap, "policy_gap": policy_gap}
    return parallel.gather_objects(mine)


if __name__ == "__main__":
    main(*sys.argv[1:4])
