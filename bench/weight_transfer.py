"""Weight transfer: learner (GPU 0) -> receiver process (GPU 1), against a raw broadcast of the same bytes.

For Qwen2-shaped bf16 state dicts (0.5B tied, 7B untied), it times the whole path streamrl runs
after an optimizer step: plan, pack into flat buckets, broadcast over the node's own NCCL group,
unpack into views on the receiver (`transfer`), and copying those views into a model's parameters
as `reload_weights` would (`transfer_apply`). The baseline, in the same run and the same process
pair: one NCCL broadcast of a preallocated flat tensor of the same byte count over a second group.
Timing is end to end across both processes: from the learner posting the command in the
TCPStore to the later of the two sides finishing (perf_counter is one monotonic clock per host).

    python bench/weight_transfer.py                      # GPU: nccl, cuda:0 -> cuda:1
    python bench/weight_transfer.py --device cpu --shapes tiny qwen2-0.5b   # gloo, CPU

Prints one JSON line per (shape, bucket size), with `ratio` = transfer / raw.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
import zlib

import msgspec
import torch

from streamrl.engine import messages
from streamrl.engine.weights import WeightSender, broadcast_async, new_group, plan_buckets, receive, wait

SHAPES = {
    "tiny": dict(hidden=64, inter=128, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=512, tied=True),
    "qwen2-0.5b": dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, head_dim=64, vocab=151936, tied=True),
    # the body of examples/gpu.toml's model (`streamrl make-tiny-model --shape 0.5b`): the tiny vocabulary
    "qwen2-0.5b-v512": dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, head_dim=64, vocab=512, tied=True),
    "qwen2-7b": dict(hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064, tied=False),
}


def _fill(name: str) -> float:
    return (zlib.crc32(name.encode()) % 251) / 8  # exact in bf16: at most 8 significant bits


def qwen2_shapes(s: dict) -> dict[str, list[int]]:
    """HF names and shapes of a Qwen2 causal LM."""
    h, q, kv = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    out = {"model.embed_tokens.weight": [s["vocab"], h]}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": [q, h],
                p + "self_attn.q_proj.bias": [q],
                p + "self_attn.k_proj.weight": [kv, h],
                p + "self_attn.k_proj.bias": [kv],
                p + "self_attn.v_proj.weight": [kv, h],
                p + "self_attn.v_proj.bias": [kv],
                p + "self_attn.o_proj.weight": [h, q],
                p + "mlp.gate_proj.weight": [s["inter"], h],
                p + "mlp.up_proj.weight": [s["inter"], h],
                p + "mlp.down_proj.weight": [h, s["inter"]],
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
            }
        )
    out["model.norm.weight"] = [h]
    if not s["tied"]:
        out["lm_head.weight"] = [s["vocab"], h]
    return out


def qwen2_state_dict(s: dict, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    sd = {name: torch.full(shape, _fill(name), dtype=dtype, device=device) for name, shape in qwen2_shapes(s).items()}
    if s["tied"]:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# ---- receiver process ---------------------------------------------------------------------------


def receiver(args) -> None:
    device = args.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=args.timeout)
    store = torch.distributed.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timeout)
    raw_group, targets, raw_buf = None, None, None
    for n in range(1 << 30):
        cmd = msgspec.msgpack.decode(store.get(f"cmd/{n}"))
        if cmd["kind"] == "stop":
            return
        if cmd["kind"] == "raw":
            if raw_group is None:
                raw_group = new_group(store, "raw/", 1, 2, args.backend, args.timeout, device)
            if raw_buf is None or raw_buf.numel() != cmd["numel"]:
                raw_buf = torch.empty(cmd["numel"], dtype=torch.bfloat16, device=device)
            wait(broadcast_async(raw_group, raw_buf, args.timeout), args.timeout)
            _sync(device)
            store.set(f"done/{n}", json.dumps({"end": time.perf_counter()}))
            continue
        ready = messages.decode_control(cmd["ready"])
        if targets is None or cmd.get("new_targets"):
            targets = {
                t.name: torch.empty(t.shape, dtype=torch.bfloat16, device=device)
                for b in ready.buckets
                for t in b.tensors
            }
        got = list(receive(ready, device, rank=1))
        _sync(device)
        end = time.perf_counter()
        torch._foreach_copy_([targets[name] for name, _ in got], [t for _, t in got])  # as apply_to_hf_model
        _sync(device)
        reply = {"end": end, "end_apply": time.perf_counter()}
        if cmd.get("check"):
            firsts = torch.stack([t.reshape(-1)[-1] for _, t in got]).float().cpu().tolist()
            expect = cmd["check"]
            reply["wrong"] = [name for (name, _), v in zip(got, firsts) if expect.get(name, v) != v]
        store.set(f"done/{n}", json.dumps(reply))


# ---- learner side ---------------------------------------------------------------------------------


class Bench:
    def __init__(self, args, sender: WeightSender):
        self.args, self.sender, self.store, self.n = args, sender, sender.store, 0
        self.raw_group = None

    def command(self, **cmd) -> tuple[float, dict]:
        n, self.n = self.n, self.n + 1
        start = time.perf_counter()
        self.store.set(f"cmd/{n}", msgspec.msgpack.encode(cmd))
        return start, n

    def done(self, n: int) -> dict:
        return json.loads(self.store.get(f"done/{n}"))

    def raw(self, flat: torch.Tensor) -> float:
        start, n = self.command(kind="raw", numel=flat.numel())
        if self.raw_group is None:
            self.raw_group = new_group(
                self.store, "raw/", 0, 2, self.sender.backend, self.args.timeout, self.args.device
            )
        wait(broadcast_async(self.raw_group, flat, self.args.timeout), self.args.timeout)
        _sync(self.args.device)
        end = time.perf_counter()
        return max(end, self.done(n)["end"]) - start

    def transfer(self, sd, specs, version: int, check: dict | None, new_targets: bool) -> tuple[float, float, dict]:
        ready = self.sender.prepare(version, specs)
        start, n = self.command(kind="weights", ready=messages.encode(ready), check=check, new_targets=new_targets)
        self.sender.send(sd, ready)
        _sync(self.args.device)
        end = time.perf_counter()
        reply = self.done(n)
        return max(end, reply["end"]) - start, max(end, reply["end_apply"]) - start, reply


def bench_shape(args, bench: Bench, name: str) -> None:
    sd = qwen2_state_dict(SHAPES[name], torch.bfloat16, args.device)
    check = {
        k: _fill(k if not (SHAPES[name]["tied"] and k == "lm_head.weight") else "model.embed_tokens.weight") for k in sd
    }
    nbytes = sum(
        t.numel() * t.element_size() for k, t in sd.items() if not (SHAPES[name]["tied"] and k == "lm_head.weight")
    )
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=args.device)
    for bucket_mb in args.bucket_mb:
        specs = plan_buckets(sd, int(bucket_mb * 2**20))
        raws, moves, applies, wrong = [], [], [], []
        for i in range(args.warmup + args.iters):
            last = i == args.warmup + args.iters - 1
            raw_s = bench.raw(flat)
            move_s, apply_s, reply = bench.transfer(sd, specs, i, check if last else None, new_targets=i == 0)
            if i >= args.warmup:
                raws.append(raw_s), moves.append(move_s), applies.append(apply_s)
            wrong = reply.get("wrong", wrong)
        raw, move, apply = (statistics.median(x) for x in (raws, moves, applies))
        print(
            json.dumps(
                {
                    "figure": "weight_transfer",
                    "shape": name,
                    "backend": bench.sender.backend,
                    "bytes": nbytes,
                    "bucket_mb": bucket_mb,
                    "buckets": len(specs),
                    "raw_ms": round(raw * 1e3, 2),
                    "transfer_ms": round(move * 1e3, 2),
                    "transfer_apply_ms": round(apply * 1e3, 2),
                    "ratio": round(move / raw, 3),
                    "ratio_apply": round(apply / raw, 3),
                    "raw_GBps": round(nbytes / raw / 1e9, 1),
                    "transfer_GBps": round(nbytes / move / 1e9, 1),
                    "bit_exact": not wrong,
                    "iters": args.iters,
                }
            ),
            flush=True,
        )
    del sd, flat


def learner(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    sender = WeightSender("bench-node", backend=args.backend, device=args.device, timeout_s=args.timeout)
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "receiver",
            "--port",
            str(sender.port),
            "--device",
            args.receiver_device,
            "--backend",
            sender.backend,
            "--timeout",
            str(args.timeout),
        ]
    )
    bench = Bench(args, sender)
    try:
        for name in args.shapes:
            bench_shape(args, bench, name)
        bench.command(kind="stop")
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=["learner", "receiver"], default="learner")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--receiver-device", default=None)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--shapes", nargs="+", default=["qwen2-0.5b", "qwen2-7b"], choices=sorted(SHAPES))
    parser.add_argument("--bucket-mb", nargs="+", type=float, default=[256.0, 1024.0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    if args.receiver_device is None:
        args.receiver_device = "cuda:1" if args.device.startswith("cuda") else args.device
    (receiver if args.role == "receiver" else learner)(args)


if __name__ == "__main__":
    main()
