"""Learner step throughput and MFU on a Qwen2-0.5B-shaped random model; one JSON line per figure.

    python bench/learner_step.py --mode baseline            # eager HF, padded [16, 1024], bf16
    python bench/learner_step.py --mode streamrl [--compile] # packed + varlen + chunked head, FSDP2
    torchrun --nproc_per_node 2 bench/learner_step.py --mode streamrl   # 2 GPUs, FSDP2

MFU = 6 * params * tokens/s / peak (989 TFLOP/s dense bf16). The streamrl figures carry
`vs_baseline` when --baseline-tps (from a baseline line of the same run) is given.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

PEAK_FLOPS = 989e12


def qwen2_05b_config(**overrides):
    from transformers import Qwen2Config

    fields = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                  rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)
    fields.update(overrides)
    return Qwen2Config(**fields)


def make_model(device, dtype, attn="sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen2_05b_config(), dtype=dtype, attn_implementation=attn)
    return model, sum(p.numel() for p in model.parameters())


def emit(**fields):
    print(json.dumps(fields), flush=True)


def timed(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def baseline(args):
    model, params = make_model("cuda", torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(0, 151936, (args.batch, args.seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed(step, args.warmup, args.steps)
    tps = args.batch * args.seq / seconds
    emit(figure="learner_step_baseline_eager_hf", tokens_per_s=round(tps), mfu=round(6 * params * tps / PEAK_FLOPS, 4),
         params=params, tokens_per_step=args.batch * args.seq, seconds_per_step=round(seconds, 4),
         peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))


def trajectories(n: int, seed: int):
    from streamrl.engine.messages import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        total = rng.randint(1024, 2048)
        prompt = [rng.randrange(151936) for _ in range(256)]
        completion = [rng.randrange(151936) for _ in range(total - 256)]
        out.append(Trajectory(sample_id=f"s{i}", group_id=f"g{i // 8}", node_id="bench", seq=i, prompt_ids=prompt,
                              completion_ids=completion, behavior_logprobs=[-11.9] * len(completion),
                              reward=float(i % 2), policy_version=0))
    return out


def streamrl(args):
    import torch.distributed as dist

    from streamrl.engine.config import LearnerConfig, LossConfig
    from streamrl.learner import parallel
    from streamrl.learner.batching import pack
    from streamrl.learner.train_step import Trainer

    device = parallel.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    model, params = make_model("cuda", torch.float32)
    cfg = LearnerConfig(lr=1e-6, micro_batch_tokens=args.budget, compile=args.compile,
                        activation_checkpointing=args.ac)
    trainer = Trainer(parallel.wrap_model(model, cfg, device, chunk=args.chunk), LossConfig(), cfg, device)
    trajs = trajectories(args.samples, seed=rank)
    mbs = pack(trajs, [1.0 if t.reward else -1.0 for t in trajs], args.budget,
               pad_to_budget=args.pad)[:args.micro_batches]
    tokens = sum(int(mb.cu_seqlens[len(mb.sample_ids)]) for mb in mbs) * world  # padding not counted
    last = {}

    def step():
        last.update(trainer.step(mbs))

    seconds = timed(step, args.warmup, args.steps)
    tps = tokens / seconds
    name = (f"learner_step_streamrl_{world}gpu" + ("_compile" if args.compile else "") + ("_pad" if args.pad else "")
            + ("_ac" if args.ac else ""))
    fields = dict(figure=name, tokens_per_s=round(tps), mfu=round(6 * params * tps / (PEAK_FLOPS * world), 4),
                  params=params, gpus=world, tokens_per_step=tokens, micro_batches_per_rank=len(mbs),
                  budget=args.budget, chunk=args.chunk, seconds_per_step=round(seconds, 4),
                  attn=model.config._attn_implementation, loss=round(last["loss"], 5),
                  skipped=last["skipped"], peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))
    if args.baseline_tps:
        fields["vs_baseline"] = round(tps / world / args.baseline_tps, 3)
    if rank == 0:
        emit(**fields)
    if args.profile:
        profile(step, args.profile if rank == 0 else None)
    parallel.shutdown()


def profile(step, path: str | None) -> None:
    """One step under the profiler; the kernels that took the most GPU time, to `path`."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if path:
        with open(path, "w") as f:
            f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["baseline", "streamrl"], default="streamrl")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--pad", action="store_true", help="pad micro-batches to the budget (static shapes)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=16384, help="tokens per packed micro-batch")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per rank per step")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=4096, help="LM-head chunk (positions)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--baseline-tps", type=float, default=0.0)
    ap.add_argument("--profile", default="", help="write a profile of one step to this file")
    args = ap.parse_args()
    baseline(args) if args.mode == "baseline" else streamrl(args)


if __name__ == "__main__":
    main()
