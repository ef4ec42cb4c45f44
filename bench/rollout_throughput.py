"""Rollout throughput: the vLLM node vs raw AsyncLLM on the same engine vs the hf node, one call.

Same model, same prompts, same config for all three.

    python -m streamrl.bench.rollout_throughput                 # CPU: the demo's config and tiny model
    python -m streamrl.bench.rollout_throughput --config examples/gpu.toml --shape 0.5b --shape 1.5b:152k \
        --shape 7b:152k                                           # one GPU: the figures of bench/RESULTS.md

For each shape (`NAME[:152k]`: engine.models.SHAPES' body, the real Qwen2 vocabulary or the tokenizer's 512), one
child process per engine family, each engine built by `build_backend` from the run's config as a node builds it:

- vllm: one engine, rounds alternating. `raw` drives its AsyncLLM directly with the node's own SamplingParams,
  every group submitted at once, outputs only counted: vLLM's own speed with these engine arguments. `node` runs
  the same groups through `RolloutNode` (the loop's code: concurrency from the config, each group scored by the
  run's reward in its worker process, trajectories built and handed to a stand-in for the learner's socket),
  with a weight push before the round and one in flight, through the path the loop takes on this host (CUDA
  IPC on a GPU, shared memory on CPU: `IpcSender`, the learner's end, in this process).
- hf: the hf backend through `RolloutNode` the same way (pushes between its batches).

A round is `--groups` groups (default: all the node runs at once). The first round of each kind is a warm-up.
`--kv-at-swap keep recompute` also runs the node in the other `rollout.kv_at_swap` setting (kind `node:MODE`,
same engine, rounds alternating). `--deltas` also runs raw and the node with outputs streamed per step where the
node takes them once per request (kinds `raw:delta`, `node:delta`; rollout/backends/vllm.py, Outputs);
`--between` the node with its push before each round alone (kind `node:between`: weights pushed between rounds).
Printed: one JSON line per engine and round (tokens, seconds, tokens/s, the requests in flight sampled every
20 ms and when the most were first in, each swap's pause and its phases: stage, pause, load, reset, resume),
then per shape `{"figure": "vllm_node", "shape", "node_tok_s", "raw_tok_s", "hf_tok_s", "vs_raw"}` (and
`KIND_tok_s` for each other kind, `node_MODE_vs_raw` against raw with the same outputs), each the median of its
timed rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VOCAB = {"": 512, "152k": 151936}  # the tokenizer's own; Qwen2-0.5B/1.5B's
SAMPLE_S = 0.02
RESULT = "ROLLOUT-RESULT "  # a child's result line on its stdout (vLLM logs there too)


class FakeLearnerSink:
    """Stands in for the node's `LedgerSink` (ledger mark + ZMQ send to the learner): counts what it is given."""

    def __init__(self) -> None:
        self.samples = self.tokens = 0

    def send(self, traj) -> int:
        self.samples += 1
        self.tokens += len(traj.completion_ids)
        return self.samples


class Pusher:
    """The learner's end of the weights, in the bench's process: the model's weights packed once into shared
    buffers (as the learner's publisher packs them) and pushed to the node as new versions, as the publisher's
    link pushes them (engine/weights/push.py)."""

    def __init__(self, model_path: str, cfg, device: str):
        import torch
        from transformers import AutoModelForCausalLM

        from streamrl.engine.weights import IpcSender, pack, plan_buckets

        # read on the host and packed straight into the device's buckets: the buckets are the one copy this
        # process keeps on the GPU (a model moved there first left its 15 GiB cached beside them at 7B, and the
        # node's first push ran out of memory on an 80 GiB H100)
        lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, cfg.model.dtype))
        weights = dict(lm.state_dict())
        self.packed = pack(plan_buckets(weights, int(cfg.weights.bucket_mb * 2**20)), weights, device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()  # the host copies are read until the packing's copies are done
        weights.clear()
        del lm
        self.sender = IpcSender("bench-node", device=device, timeout_s=cfg.weights.timeout_s)
        self.pushed = 0  # versions handed to the node so far

    async def push(self, node) -> float:
        from streamrl.engine.weights import push_in_process

        self.pushed += 1
        return await push_in_process(self.sender, self.pushed, self.packed, node.apply_weights)

    def close(self) -> None:
        self.sender.close()


async def _sampled(engine, work) -> tuple[object, dict]:
    """Run `work`, sampling the engine's unfinished requests (its front end's count) every SAMPLE_S; `full_s`:
    when the most of them were first in (the admission's ramp); `drained_s`: the last sample with one in (after
    it, the round's own tail: the node scoring and sending its last groups)."""
    counts, task, start = [], asyncio.ensure_future(work), time.perf_counter()
    processor, full_s, drained_s = getattr(engine, "output_processor", None), 0.0, 0.0
    while not task.done():
        if processor is not None:
            counts.append(processor.get_num_unfinished_requests())
            now = time.perf_counter() - start
            full_s = now if counts[-1] > max(counts[:-1], default=0) else full_s
            drained_s = now if counts[-1] else drained_s
        await asyncio.wait([task], timeout=SAMPLE_S)
    if not counts:
        return task.result(), {}
    drained_s = time.perf_counter() - start if counts[-1] else drained_s  # cut off with requests still in
    return task.result(), {"requests_mean": round(statistics.fmean(counts), 1), "requests_max": max(counts),
                           "full_s": round(full_s, 3), "drained_s": round(drained_s, 3)}  # fmt: skip


def generate_all(engine, prompt_ids: list[list[int]], params) -> asyncio.Future:
    """Every prompt submitted at once to an AsyncLLM with `params`: the tokens each request made, outputs only
    counted (vLLM's own speed with its engine arguments)."""

    async def one(i: int, ids: list[int]) -> int:
        tokens = 0
        async for out in engine.generate({"prompt_token_ids": ids}, params, f"raw-{time.monotonic_ns()}-{i}"):
            tokens += sum(len(o.token_ids) for o in out.outputs)
        return tokens

    return asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompt_ids)))


async def _raw_round(backend, prompts, cfg) -> dict:
    """Every group submitted at once to the backend's AsyncLLM with the node's SamplingParams; tokens counted."""
    params = backend.sampling_params(cfg.rollout.group_size, cfg.rollout.max_tokens)
    start = time.perf_counter()
    counts, in_flight = await _sampled(
        backend._engine, generate_all(backend._engine, [p.prompt_ids for p in prompts], params)
    )
    return {"tokens": sum(counts), "seconds": time.perf_counter() - start, **in_flight}


async def _node_round(cfg, backend, prompts, scorer, tokenizer, device: str, pusher: Pusher | None, mid_s: float):
    """The groups through the loop's node code; a push before the round and one `mid_s` into it."""
    from streamrl.rollout.node import RolloutNode

    sink, swaps, phases = FakeLearnerSink(), [], []
    node = RolloutNode(cfg, "bench-node", backend, list(prompts), scorer, sink, tokenizer, device=device)

    async def push() -> None:
        swaps.append(await pusher.push(node))
        phases.append(getattr(backend, "last_swap", {}))

    if pusher is not None:
        await push()

    async def push_later() -> None:
        await asyncio.sleep(mid_s)
        await push()

    later = asyncio.create_task(push_later()) if pusher is not None and mid_s > 0 else None
    start = time.perf_counter()
    _, in_flight = await _sampled(getattr(backend, "_engine", None), node.run(max_groups=len(prompts)))
    seconds = time.perf_counter() - start
    if later is not None:
        await later
    return {"tokens": sink.tokens, "seconds": seconds, "swaps_s": [round(s, 3) for s in swaps], "phases": phases,
            **in_flight}  # fmt: skip


def _streamed(backend):
    """`backend.sampling_params` with outputs per step (DELTA) whatever the backend's own choice."""
    from vllm.sampling_params import RequestOutputKind

    own = type(backend).sampling_params

    def params(n: int, max_tokens: int, sampling=None):
        got = own(backend, n, max_tokens, sampling)
        got.output_kind = RequestOutputKind.DELTA
        return got

    return params


def _extra_kinds(args, cfg) -> list[str]:
    """The vLLM kinds run besides raw and node (module doc): node:MODE for each other `rollout.kv_at_swap`,
    raw:delta and node:delta, node:between."""
    kinds = [f"node:{m}" for m in args.kv_at_swap if m != cfg.rollout.kv_at_swap]
    kinds += ["raw:delta", "node:delta"] if args.deltas else []
    return kinds + (["node:between"] if args.between else [])


async def _measure(family: str, cfg, model: str, device: str, groups: int, rounds: int, extra=()) -> list[dict]:
    """extra: the vLLM kinds besides raw and node (`_extra_kinds`)."""
    from streamrl.engine.models import load_tokenizer
    from streamrl.engine.placement import node_groups
    from streamrl.rewards import build_scorer
    from streamrl.rollout.backends import build_backend
    from streamrl.rollout.sources import PromptSource

    tokenizer = load_tokenizer(model, cfg.model.trust_remote_code)
    source = iter(PromptSource(cfg.data, tokenizer, seed=cfg.run.seed))
    prompts = [next(source) for _ in range(groups or node_groups(cfg, device))]
    scorer = build_scorer(cfg.reward, answer_column=cfg.data.answer_column)
    backend = build_backend(cfg, device)
    pusher = Pusher(model, cfg, device) if family == "vllm" else None
    await backend.warm_up()
    kinds = ["raw", "node", *extra] if family == "vllm" else ["hf"]
    lines, mid_s = [], 0.0
    try:
        for round_ in range(rounds + 1):
            for kind in kinds:
                engine, _, mode = kind.partition(":")
                if family == "vllm":
                    backend.keep_kv = (mode if mode in ("keep", "recompute") else cfg.rollout.kv_at_swap) == "keep"
                    vars(backend).pop("sampling_params", None)  # the backend's own
                    if mode == "delta":
                        backend.sampling_params = _streamed(backend)
                if engine == "raw":
                    got = await _raw_round(backend, prompts, cfg)
                else:
                    in_flight = 0.0 if mode == "between" else mid_s
                    got = await _node_round(cfg, backend, prompts, scorer, tokenizer, device, pusher, in_flight)
                    mid_s = mid_s or got["seconds"] / 2  # pushes in flight from the first timed round on
                got |= {"tokens_per_s": round(got["tokens"] / got["seconds"], 1), "seconds": round(got["seconds"], 3)}
                lines.append({"engine": kind, "round": round_, "warm_up": round_ == 0, "groups": len(prompts), **got})
                print(json.dumps(lines[-1]), file=sys.stderr, flush=True)
    finally:
        if pusher is not None:
            pusher.close()
        await backend.close()
        scorer.close()
    return lines


def _parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="", help="the run's config (default: the demo's)")
    parser.add_argument("--set", action="append", default=[], help="config override, as streamrl run --set")
    parser.add_argument("--shape", action="append", default=[], help="SHAPE[:152k] (default: the config's model)")
    parser.add_argument("--groups", type=int, default=0, help="groups a round (0: all the node runs at once)")
    parser.add_argument("--hf-groups", type=int, default=0, help="the hf node's groups a round (0: --groups)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of each engine after a warm-up round")
    parser.add_argument("--engines", nargs="+", default=["vllm", "hf"], choices=("vllm", "hf"))
    parser.add_argument(
        "--kv-at-swap",
        nargs="+",
        default=[],
        choices=("recompute", "keep"),
        help="also run the vLLM node with these rollout.kv_at_swap settings (kinds node:MODE)",
    )
    parser.add_argument(
        "--deltas",
        action="store_true",
        help="also raw and the node with outputs per step (kinds raw:delta, node:delta)",
    )
    parser.add_argument(
        "--between", action="store_true", help="also the node with no push in flight, one before each round alone"
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default="", help="also append the figure lines to this file")
    parser.add_argument("--only", help=argparse.SUPPRESS)  # FAMILY:MODEL, in a child
    return parser.parse_args(argv)


def _config(args, model: str, device: str, family: str = "vllm"):
    from streamrl.engine.config import load
    from streamrl.ops.run import DEMO

    base = [] if args.config else [*DEMO, "learner.groups_per_step=4"]
    sets = [*base, *args.set, f"model.path='{model}'", f"run.device='{device}'", f"rollout.backend='{family}'",
            "telemetry.tensorboard=false"]  # fmt: skip
    return load(args.config or None, sets)


def _child(args, family: str, model: str, groups: int) -> list[dict]:
    """One engine family in a process of its own: vLLM changes the threads of its process, and GPU memory is
    given back when the process ends."""
    cmd = [sys.executable, "-m", "streamrl.bench.rollout_throughput", "--only", f"{family}:{model}",
           "--groups", str(groups), "--rounds", str(args.rounds), "--device", args.device,
           *(["--kv-at-swap", *args.kv_at_swap] if args.kv_at_swap else []), *(["--deltas"] if args.deltas else []),
           *(["--between"] if args.between else []),
           *(["--config", args.config] if args.config else []), *[f"--set={s}" for s in args.set]]  # fmt: skip
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600)
    lines = [json.loads(line[len(RESULT) :]) for line in out.stdout.splitlines() if line.startswith(RESULT)]
    if out.returncode or not lines:
        raise RuntimeError(f"{family} on {model}: exit {out.returncode} (its error is above)")
    return lines[-1]


def _model(shape: str, folder: str) -> str:
    from streamrl.engine.models import SHAPES, make_tiny_model

    body, _, vocab = shape.partition(":")
    if vocab not in VOCAB:
        raise SystemExit(f"--shape {shape}: the vocabulary is '' or '152k'")
    path = os.path.join(folder, shape.replace(":", "-"))
    import torch

    on_gpu = torch.cuda.is_available()
    make_tiny_model(path, seed=0, model_vocab_size=VOCAB[vocab], dtype="bfloat16" if on_gpu else "float32",
                    device="cuda" if on_gpu else "cpu", **SHAPES[body])  # fmt: skip
    return path


def _config_model(args) -> str:
    from streamrl.engine.models import default_tiny_model

    return _config(args, "", "cpu").model.path or str(default_tiny_model())


def _figure(shape: str, lines: list[dict]) -> dict:
    def median(kind: str) -> float:
        timed = [line["tokens_per_s"] for line in lines if line["engine"] == kind and not line["warm_up"]]
        return round(statistics.median(timed), 1) if timed else 0.0

    node, raw, hf = median("node"), median("raw"), median("hf")
    figure = {"figure": "vllm_node", "shape": shape, "node_tok_s": node, "raw_tok_s": raw, "hf_tok_s": hf}
    for kind in sorted({line["engine"] for line in lines if ":" in line["engine"]}):
        name, mode = kind.replace(":", "_"), kind.partition(":")[2]
        figure[f"{name}_tok_s"] = median(kind)
        if kind.startswith("node:"):  # against raw with the same outputs (raw:delta for node:delta)
            base = median(f"raw:{mode}") or raw
            figure[f"{name}_vs_raw"] = round(median(kind) / base, 3) if base else None
    vs_raw, vs_hf = (round(node / raw, 3) if raw else None), (round(node / hf, 3) if hf and node else None)
    return figure | {"vs_raw": vs_raw, "vs_hf": vs_hf}


def main(argv=None) -> None:
    args = _parse(argv)
    from streamrl.rollout.backends import resolve_device

    if resolve_device(args.device) == "cpu":  # no compile on the first logprobs request (FINDINGS); the children too
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    if args.only:
        family, _, model = args.only.partition(":")
        device = resolve_device(args.device)
        cfg = _config(args, model, device, family)
        extra = _extra_kinds(args, cfg)
        lines = asyncio.run(_measure(family, cfg, model, device, args.groups, args.rounds, extra))
        print(RESULT + json.dumps(lines), flush=True)
        return
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shape or [""]:
            model = _model(shape, tmp) if shape else _config_model(args)
            lines, failed = [], {}
            for family in args.engines:
                groups = args.hf_groups if family == "hf" and args.hf_groups else args.groups
                try:
                    lines += _child(args, family, model, groups)
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other engines' figures still count
                    failed[f"{family}_error"] = str(e)
                    print(f"{family} on {shape or 'config'} failed: {e}", file=sys.stderr, flush=True)
            figure = _figure(shape or "config", lines) | failed | {"settings": args.config or "demo", "sets": args.set}
            print(json.dumps(figure), flush=True)
            failures += len(failed)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(figure) + "\n")
            if shape:
                import shutil

                shutil.rmtree(model, ignore_errors=True)
    if failures:
        raise SystemExit(f"{failures} engine run(s) failed; the figures above leave them out")


if __name__ == "__main__":
    main()
