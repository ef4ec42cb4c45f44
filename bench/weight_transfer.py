"""Weight transfer: learner -> receiver process, against a raw broadcast (or copy) of the same bytes.

For Qwen2-shaped bf16 state dicts (0.5B tied, 7B untied), it times the whole path streamrl runs
after an optimizer step: plan, pack into flat buckets, broadcast over the node's own NCCL group,
unpack into views on the receiver (`transfer`), and copying those views into a model's parameters
as `reload_weights` would (`transfer_apply`). The baseline, in the same run and the same process
pair: one NCCL broadcast of a preallocated flat tensor of the same byte count over a second group.
Timing is end to end across both processes: from the learner posting the command in the
TCPStore to the later of the two sides finishing (perf_counter is one monotonic clock per host).

    python bench/weight_transfer.py                      # GPU: nccl, cuda:0 -> cuda:1
    python bench/weight_transfer.py --device cpu --shapes tiny qwen2-0.5b   # gloo, CPU
    python bench/weight_transfer.py --paths collective shared --device cpu  # gloo vs shared memory, one host
    python bench/weight_transfer.py --paths shared --receiver-device cuda:0  # CUDA IPC, one GPU
    python bench/weight_transfer.py --lora 16 ...        # a LoRA push: rank-16 adapters on every linear layer

Prints one JSON line per (path, shape, bucket size), with `ratio` = transfer / raw. The shared paths
(`engine/weights/ipc.py`) have no broadcast: their line says what the learner is held for (`pack_ms`:
packing into the shared buffers, host; `pack_device_ms` on a GPU), the node's copy out of them
(`copy_device_ms` on a GPU, `copy_ms` its wall time to the confirmation), and against them a plain
`copy_` of the same bytes in one process (`raw_copy_ms`).
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
from streamrl.engine.models import SHAPES, tiny_config
from streamrl.engine.weights import (
    IpcSender,
    Stager,
    WeightSender,
    broadcast_async,
    new_group,
    plan_buckets,
    receive,
    shared_empty,
    wait,
)
from streamrl.engine.weights.layout import BufferPool, PackedBuckets

# Benchmark name -> (engine.models.SHAPES body, vocabulary).
MODELS = {
    "tiny": ("tiny", 512),
    "qwen2-0.5b": ("0.5b", 151936),
    "qwen2-0.5b-v512": ("0.5b", 512),  # the body of examples/gpu.toml's model (`make-tiny-model --shape 0.5b`)
    "qwen2-7b": ("7b", 152064),
}


def model_shape(name: str) -> dict:
    body, vocab = MODELS[name]
    c = tiny_config(vocab, **SHAPES[body])
    return dict(
        hidden=c.hidden_size,
        inter=c.intermediate_size,
        layers=c.num_hidden_layers,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab=vocab,
        tied=c.tie_word_embeddings,
    )


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


def lora_shapes(s: dict, rank: int) -> dict[str, list[int]]:
    """A LoRA adapter of `rank` on every linear layer of the decoder, under PEFT's saved names (what a push holds)."""
    h, q, kv, inter = s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["inter"]
    sides = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
             "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
             "mlp.down_proj": (inter, h)}  # fmt: skip
    out = {}
    for i in range(s["layers"]):
        for module, (d_in, d_out) in sides.items():
            p = f"base_model.model.model.layers.{i}.{module}."
            out.update({p + "lora_A.weight": [rank, d_in], p + "lora_B.weight": [d_out, rank]})
    return out


def qwen2_state_dict(s: dict, dtype: torch.dtype, device: str, lora: int = 0) -> dict[str, torch.Tensor]:
    """The full weights, or with `lora` > 0 an adapter of that rank alone (never tied)."""
    shapes = lora_shapes(s, lora) if lora else qwen2_shapes(s)
    sd = {name: torch.full(shape, _fill(name), dtype=dtype, device=device) for name, shape in shapes.items()}
    if s["tied"] and not lora:
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
    raw_group, targets, raw_buf, stager = None, None, None, Stager(device)
    for n in range(1 << 30):
        cmd = msgspec.msgpack.decode(store.get(f"cmd/{n}"))
        if cmd["kind"] == "stop":
            return
        if cmd["kind"] == "shared":
            store.set(f"done/{n}", json.dumps(_receive_shared(stager, cmd, device)))
            continue
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


def _receive_shared(stager: Stager, cmd: dict, device: str) -> dict:
    """One version from the learner's shared buffers into staging: the node's copy, timed."""
    start = time.perf_counter()
    staged = stager.receive(messages.decode_control(cmd["ready"]))
    _sync(device)
    reply = {"end": time.perf_counter(), "copy_s": time.perf_counter() - start, "copy_device_s": staged.copy_s}
    if cmd.get("check"):
        firsts = torch.stack([t.reshape(-1)[-1] for _, t in staged.named]).float().cpu().tolist()
        reply["wrong"] = [name for (name, _), v in zip(staged.named, firsts) if cmd["check"].get(name, v) != v]
    stager.release()
    return reply


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
    shape = dict(model_shape(name), tied=model_shape(name)["tied"] and not args.lora)
    sd = qwen2_state_dict(shape, torch.bfloat16, args.device, args.lora)
    check = {k: _fill(k if not (shape["tied"] and k == "lm_head.weight") else "model.embed_tokens.weight") for k in sd}
    nbytes = sum(t.numel() * t.element_size() for k, t in sd.items() if not (shape["tied"] and k == "lm_head.weight"))
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
                    "lora_rank": args.lora,
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


def _timed(fn, device: str) -> tuple[float, float]:
    """(host seconds of the call, device seconds of what it queued; the host's on CPU), from an idle device."""
    _sync(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if device.startswith("cuda") else None
    if events:
        events[0].record()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    if events:
        events[1].record()
    _sync(device)
    return host, (events[0].elapsed_time(events[1]) / 1e3 if events else time.perf_counter() - start)


def _pack_foreach(packed: PackedBuckets, sd: dict) -> None:
    """The packing as one `_foreach_copy_` into views of the buckets (against `torch.cat`, the default)."""
    outs, ins = [], []
    for i, spec in enumerate(packed.specs):
        flat, end = packed.pool.take(i, torch.bfloat16, spec.numel, packed.device), 0
        for ts in spec.tensors:
            if ts.offset == end:
                outs.append(flat[end : end + ts.numel])
                ins.append(sd[ts.name].view(-1))
                end += ts.numel
    torch._foreach_copy_(outs, ins)


def bench_shared(args, bench: Bench, sender: IpcSender, name: str) -> None:
    """The shared path (`cuda_ipc` on one GPU, `shm` on CPU): the learner packs into one of two buffer
    sets (as the publisher cycles them) and the node copies out of it, against a plain copy_ of the bytes."""
    sd = qwen2_state_dict(model_shape(name), torch.bfloat16, args.device, args.lora)
    tied = model_shape(name)["tied"] and not args.lora
    check = {k: _fill("model.embed_tokens.weight" if tied and k == "lm_head.weight" else k) for k in sd}
    nbytes = sum(t.numel() * t.element_size() for k, t in sd.items() if not (tied and k == "lm_head.weight"))
    src, dst = (torch.empty(nbytes // 2, dtype=torch.bfloat16, device=args.device) for _ in range(2))
    for bucket_mb in args.bucket_mb:
        specs, pools = plan_buckets(sd, int(bucket_mb * 2**20)), [BufferPool(allocate=shared_empty) for _ in range(2)]
        rows, wrong = [], []
        for i in range(args.warmup + args.iters):
            last = i == args.warmup + args.iters - 1
            raw = _timed(lambda: dst.copy_(src), args.device)
            packed = PackedBuckets(specs, sd, args.device, pools[i % 2], check=i < 2)
            pack = _timed(lambda packed=packed: [packed.get(j) for j in range(len(packed))], args.device)
            foreach = _timed(lambda packed=packed: _pack_foreach(packed, sd), args.device)
            ready = sender.prepare(i, packed)
            start, n = bench.command(kind="shared", ready=messages.encode(ready), check=check if last else None)
            sender.send(packed, ready)
            reply = bench.done(n)
            wrong = reply.get("wrong", wrong)
            if i >= args.warmup:
                rows.append((raw[1], *pack, *foreach, reply["copy_s"], reply["copy_device_s"],
                             max(time.perf_counter(), reply["end"]) - start))  # fmt: skip
        med = [statistics.median(col) * 1e3 for col in zip(*rows)]
        raw_ms, pack_ms, pack_dev_ms, foreach_host_ms, foreach_ms, copy_ms, copy_dev_ms, transfer_ms = med
        hold_ms = max(pack_ms, pack_dev_ms)  # the learner's stream is busy for the device time too
        out = {"figure": "weight_transfer_shared", "path": sender.path, "shape": name, "lora_rank": args.lora,
               "bytes": nbytes,
               "bucket_mb": bucket_mb, "buckets": len(specs), "raw_copy_ms": raw_ms, "pack_ms": pack_ms,
               "pack_device_ms": pack_dev_ms, "pack_foreach_ms": foreach_host_ms, "pack_foreach_device_ms": foreach_ms,
               "hold_ms": hold_ms,
               "copy_ms": copy_ms, "copy_device_ms": copy_dev_ms, "transfer_ms": transfer_ms,
               "hold_vs_copy": hold_ms / raw_ms, "node_copy_vs_copy": (copy_dev_ms or copy_ms) / raw_ms,
               "bit_exact": not wrong, "iters": args.iters}  # fmt: skip
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}), flush=True)


def learner(args) -> None:
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    sender = WeightSender("bench-node", backend=args.backend, device=args.device, timeout_s=args.timeout)
    command = [sys.executable, __file__, "--role", "receiver", "--port", str(sender.port), "--device",
               args.receiver_device, "--backend", sender.backend, "--timeout", str(args.timeout)]  # fmt: skip
    child = subprocess.Popen(command)
    bench = Bench(args, sender)
    try:
        for name in args.shapes:
            if "collective" in args.paths:
                bench_shape(args, bench, name)
            if "shared" in args.paths:
                bench_shared(args, bench, IpcSender("bench-node", device=args.device, timeout_s=args.timeout), name)
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
    parser.add_argument("--shapes", nargs="+", default=["qwen2-0.5b", "qwen2-7b"], choices=sorted(MODELS))
    parser.add_argument("--bucket-mb", nargs="+", type=float, default=[256.0, 1024.0])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--paths", nargs="+", default=["collective"], choices=["collective", "shared"])
    parser.add_argument("--lora", type=int, default=0, help="push a LoRA adapter of this rank (all linear layers)")
    args = parser.parse_args()
    if args.receiver_device is None:
        args.receiver_device = "cuda:1" if args.device.startswith("cuda") else args.device
    (receiver if args.role == "receiver" else learner)(args)


if __name__ == "__main__":
    main()
