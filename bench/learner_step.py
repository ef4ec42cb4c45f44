"""Learner step throughput and MFU on a Qwen2-0.5B-shaped random model; one JSON line per figure.

    python bench/learner_step.py --mode baseline            # eager HF, padded [16, 1024], bf16
    python bench/learner_step.py --mode streamrl [--compile] # packed + varlen + chunked head, FSDP2
    torchrun --nproc_per_node 2 bench/learner_step.py --mode streamrl   # 2 GPUs, FSDP2
    python bench/learner_step.py --shape tiny --samples 8 --budget 512   # a CPU smoke run of the same code

--head-logits-gib 0 recomputes the LM-head logits in backward (the pre-kept-logits path), for a
before/after in one session. --profile writes the top kernels of one step and prints where the
step's GPU time went (matmul, attention, fused, elementwise, optimizer, comms), how much of
the step the GPU was busy, its longest idle stretches with the host ops that ran meanwhile, and
the source lines where the step made the host wait for the GPU. --no-gather-ahead gathers the
parameters in the next forward instead of right after the optimizer step; --compiled-head runs the
LM head's row math compiled by torch.compile instead of the Triton kernels. --unit-params 1 shards a
FSDP unit per decoder layer (how large models shard); --compile-model compiles the decoder as one
region instead of layer by layer.
Measured figures and the commands behind them: bench/RESULTS.md.

MFU = 6 * params * tokens/s / peak (989 TFLOP/s dense bf16); with --lora (PEFT adapters on every linear layer,
HF + PEFT as the baseline) 4 FLOPs per frozen parameter and 6 per adapter one, and `mfu_4n` at 4 * params.
The streamrl figures carry `vs_baseline` when --baseline-tps (from a baseline line of the same run) is given.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from streamrl.bench._profile import gap_totals, idle_gaps, profile, sync  # noqa: F401 (tests read gaps here)
from streamrl.engine.models import SHAPES

PEAK_FLOPS = 989e12


def qwen2_05b_config(**overrides):
    from transformers import Qwen2Config

    fields = dict(
        vocab_size=151936,
        **SHAPES["0.5b"],  # the layers; the vocabulary and the rest are Qwen2-0.5B's own
        max_position_embeddings=32768,
        rope_theta=1e6,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


def _tiny() -> dict:
    return dict(vocab_size=4096, **SHAPES["tiny-4h"])


def make_model(device, dtype, attn="sdpa", shape="0.5b", vocab: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    body = _tiny() if shape == "tiny" else dict(SHAPES["7b"], vocab_size=152064) if shape == "7b" else {}
    config = qwen2_05b_config(**{**body, **({"vocab_size": vocab} if vocab else {})})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model, sum(p.numel() for p in model.parameters())


def emit(**fields):
    print(json.dumps(fields), flush=True)


def timed(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - start) / steps


def lora_flops(model, rank: int) -> tuple[int, str]:
    """FLOPs per token of a LoRA step: 4 per frozen parameter (forward + input gradients), 6 per adapter one."""
    trained, frozen = (sum(p.numel() for p in model.parameters() if p.requires_grad is t) for t in (True, False))
    return 4 * frozen + 6 * trained, f"4 x {frozen} frozen + 6 x {trained} adapter parameters (rank {rank})"


def baseline(args):
    model, params = make_model("cuda", torch.bfloat16, shape=args.shape, vocab=args.vocab)
    flops, formula = 6 * params, "6 x params"
    if args.lora:  # HF + PEFT, eager, bf16 base: the reference LoRA learner
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules="all-linear"))
        flops, formula = lora_flops(model, args.lora)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed(step, args.warmup, args.steps)
    tps = args.batch * args.seq / seconds
    emit(
        figure="learner_step_baseline_eager_hf" + (f"_peft_r{args.lora}_{args.shape}" if args.lora else ""),
        tokens_per_s=round(tps),
        mfu=round(flops * tps / PEAK_FLOPS, 4),
        mfu_4n=round(4 * params * tps / PEAK_FLOPS, 4),
        flops_formula=formula,
        params=params,
        tokens_per_step=args.batch * args.seq,
        seconds_per_step=round(seconds, 4),
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
    )


def trajectories(n: int, seed: int, vocab: int, longest: int):
    from streamrl.engine.messages import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        total = rng.randint(longest // 2, longest)
        prompt = [rng.randrange(vocab) for _ in range(total // 8)]
        completion = [rng.randrange(vocab) for _ in range(total - total // 8)]
        out.append(
            Trajectory(
                sample_id=f"s{i}",
                group_id=f"g{i // 8}",
                node_id="bench",
                seq=i,
                prompt_ids=prompt,
                completion_ids=completion,
                behavior_logprobs=[-11.9] * len(completion),
                reward=float(i % 2),
                policy_version=0,
            )
        )
    return out


def streamrl(args):
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from streamrl.engine.config import LearnerConfig, LossConfig
    from streamrl.learner import parallel
    from streamrl.learner.batching import pack
    from streamrl.learner.train_step import Trainer

    if args.compiled_head:  # the before of the Triton head kernels
        from streamrl.learner import logprobs

        logprobs.TRITON_HEAD = False
    device = parallel.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    model, params = make_model(
        device, torch.bfloat16 if args.lora else torch.float32, shape=args.shape, vocab=args.vocab
    )
    flops, formula = 6 * params, "6 x params"
    if args.lora:  # a frozen bf16 base, fp32 adapters (learner/lora.py), as the learner builds it
        from streamrl.engine.config import LoraConfig
        from streamrl.learner import lora

        model, _ = lora.apply(model, LoraConfig(enabled=True, rank=args.lora, alpha=2.0 * args.lora), torch.bfloat16)
        flops, formula = lora_flops(model, args.lora)
    cfg = LearnerConfig(
        lr=1e-6,
        micro_batch_tokens=args.budget,
        compile=args.compile and not args.compile_model,
        activation_checkpointing=args.ac,
        head_logits_gib=args.head_logits_gib,
        fsdp_unit_params=args.unit_params,
    )
    policy = parallel.wrap_model(model, cfg, device, chunk=args.chunk)
    if args.compile_model:
        policy.lm.model.compile()
    trainer = Trainer(policy, LossConfig(), cfg, device, gather_ahead=not args.no_gather_ahead)
    units = sum(isinstance(m, FSDPModule) for m in policy.modules())
    longest = min(args.longest or 2048, args.budget)
    trajs = trajectories(args.samples, seed=rank, vocab=model.config.vocab_size, longest=longest)
    mbs = pack(trajs, [1.0 if t.reward else -1.0 for t in trajs], args.budget, pad_to_budget=args.pad)[
        : args.micro_batches
    ]
    tokens = sum(int(mb.cu_seqlens[len(mb.sample_ids)]) for mb in mbs) * world  # padding not counted
    last = {}

    def step():
        last.update(trainer.step(mbs))

    seconds = timed(step, args.warmup, args.steps)
    tps = tokens / seconds
    name = (
        f"learner_step_streamrl_{world}{device.type}"
        + ("_compile" if args.compile else "")
        + ("_pad" if args.pad else "")
        + ("_ac" if args.ac else "")
        + ("_recompute" if not args.head_logits_gib else "")
        + ("_model" if args.compile_model else "")
        + (f"_{units}units" if units > 1 else "")
        + (f"_{args.shape}" if args.shape != "0.5b" else "")
        + (f"_lora_r{args.lora}" if args.lora else "")
        + (f"_vocab{args.vocab}" if args.vocab else "")
        + (f"_len{longest}" if args.longest else "")
        + ("_nogatherahead" if args.no_gather_ahead else "")
        + ("_compiledhead" if args.compiled_head else "")
    )
    fields = dict(
        figure=name,
        tokens_per_s=round(tps),
        mfu=round(flops * tps / (PEAK_FLOPS * world), 4),
        mfu_4n=round(4 * params * tps / (PEAK_FLOPS * world), 4),
        flops_formula=formula,
        params=params,
        gpus=world,
        tokens_per_step=tokens,
        micro_batches_per_rank=len(mbs),
        budget=args.budget,
        chunk=policy.chunk,
        seconds_per_step=round(seconds, 4),
        attn=model.config._attn_implementation,
        loss=round(last["loss"], 5),
        skipped=last["skipped"],
        peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1) if device.type == "cuda" else None,
    )
    if args.baseline_tps:
        fields["vs_baseline"] = round(tps / world / args.baseline_tps, 3)
    if args.profile:
        fields.update(profile(step, args.profile if rank == 0 else None))
    if rank == 0:
        emit(**fields)
    parallel.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["baseline", "streamrl"], default="streamrl")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument(
        "--pad",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="pad micro-batches to the budget (static shapes)",
    )
    ap.add_argument(
        "--compiled-head",
        action="store_true",
        help="the LM head's row math by torch.compile instead of the Triton kernels",
    )
    ap.add_argument(
        "--no-gather-ahead",
        action="store_true",
        help="gather the parameters in the next forward, not right after the optimizer step",
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=16384, help="tokens per packed micro-batch")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per rank per step")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=0, help="LM-head chunk (positions); 0: the learner's choice")
    ap.add_argument("--head-logits-gib", type=float, default=16.0, help="learner.head_logits_gib (0: recompute)")
    ap.add_argument("--unit-params", type=int, default=10**9, help="learner.fsdp_unit_params (1: a unit per layer)")
    ap.add_argument("--compile-model", action="store_true", help="compile the whole decoder, not layer by layer")
    ap.add_argument("--shape", choices=["0.5b", "7b", "tiny"], default="0.5b", help="tiny: a CPU smoke run")
    ap.add_argument("--lora", type=int, default=0, help="train LoRA adapters of this rank on every linear layer")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the shape's own)")
    ap.add_argument("--longest", type=int, default=0, help="longest sample in tokens (0: min(2048, budget))")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--baseline-tps", type=float, default=0.0)
    ap.add_argument("--profile", default="", help="write a profile of one step to this file")
    args = ap.parse_args()
    baseline(args) if args.mode == "baseline" else streamrl(args)


if __name__ == "__main__":
    main()
