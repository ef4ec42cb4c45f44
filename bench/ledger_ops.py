"""Ledger cost against a learner step, both measured in this run; one JSON line per figure.

A simulated run against an embedded Redis (append-only on, as the product runs it): per group a
node takes a credit and marks its samples generated; per step the learner heartbeats nothing but
calls `receive`, `commit_step` and `reap_lost_nodes` (its whole hot path, three round trips).
The baseline is one training step (forward, backward, AdamW) of a Qwen2 on the same batch:
the built-in tiny model (a worst case: real steps are far longer), and with `--models tiny,40M`
a ~40M one too (minutes per step on a loaded 2-core machine).

    python -m streamrl.bench.ledger_ops [--steps 50] [--groups 8] [--group-size 8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.messages import Trajectory
from streamrl.engine.models import SHAPES
from streamrl.engine.redis_server import RedisServer, connect

# model name -> engine.models.SHAPES body and vocabulary
MODELS = {"tiny": {}, "40M": dict(vocab_size=32000, **SHAPES["medium-kv4"])}


def _trajectories(ids: list[str], node: str, version: int, tokens: int) -> list[Trajectory]:
    return [
        Trajectory(
            sample_id=s,
            group_id=s.split(":")[0],
            node_id=node,
            seq=0,
            prompt_ids=[1] * 16,
            completion_ids=[2] * tokens,
            behavior_logprobs=[-1.0] * tokens,
            reward=1.0,
            policy_version=version,
        )
        for s in ids
    ]


def simulate(ledger: Ledger, steps: int, groups: int, group_size: int, tokens: int) -> dict[str, float]:
    """Seconds spent in ledger calls, split into node side and learner side, over `steps` steps."""
    node_s = learner_s = 0.0
    version = ledger.current_version()
    for step in range(version, version + steps):
        batch = []
        t0 = time.perf_counter()
        for g in range(groups):
            ids = ledger.take_credit("node-0", f"s{step}g{g}", group_size)
            assert ids is not None, "the benchmark resolves every group each step; a credit must be free"
            trajectories = _trajectories(ids, "node-0", version, tokens)
            ledger.mark_generated(trajectories)
            batch += trajectories
        t1 = time.perf_counter()
        got = ledger.receive(batch, current_version=version)
        version += 1
        ledger.commit_step([s.sample_id for s in got.fresh], version, step=version)
        ledger.reap_lost_nodes()
        t2 = time.perf_counter()
        node_s += t1 - t0
        learner_s += t2 - t1
        if step % 10 == 0:
            ledger.heartbeat("node-0")
    return {"node_s": node_s, "learner_s": learner_s}


def learner_step_seconds(model_name: str, samples: int, tokens: int, repeats: int = 3) -> float:
    """Median wall time of one forward + backward + AdamW step on `samples` sequences of `tokens`."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.engine.models import tiny_config

    overrides = dict(MODELS[model_name])
    config = tiny_config(overrides.pop("vocab_size", 512), **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (samples, tokens))
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--groups", type=int, default=8, help="groups per learner step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="completion tokens per sample")
    parser.add_argument("--models", default="tiny", help=f"baseline models, comma-separated, of {', '.join(MODELS)}")
    args = parser.parse_args()
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"--models {args.models}: unknown {sorted(unknown)}; choose from {', '.join(MODELS)}")
    samples = args.groups * args.group_size
    with tempfile.TemporaryDirectory() as folder, RedisServer(folder) as server:
        ledger = Ledger(connect(server.url), "bench", LedgerConfig(max_staleness=1))
        ledger.init_run(groups_per_step=args.groups)
        ledger.heartbeat("node-0")
        simulate(ledger, 3, args.groups, args.group_size, args.tokens)  # warm-up: scripts loaded
        spent = simulate(ledger, args.steps, args.groups, args.group_size, args.tokens)
        assert ledger.check() == [], ledger.check()
    n = args.steps * samples
    shape = {"groups_per_step": args.groups, "group_size": args.group_size, "steps": args.steps}
    per_step = spent["learner_s"] / args.steps
    _emit("ledger_seconds_per_sample", (spent["node_s"] + spent["learner_s"]) / n, "s", **shape)
    _emit("ledger_samples_per_second", n / (spent["node_s"] + spent["learner_s"]), "samples/s", **shape)
    _emit("ledger_learner_seconds_per_step", per_step, "s", **shape)
    for name in args.models.split(","):
        step_s = learner_step_seconds(name, samples, 16 + args.tokens)
        _emit("learner_step_seconds", step_s, "s", model=name, samples=samples, tokens=16 + args.tokens)
        _emit(
            "ledger_share_of_learner_step",
            per_step / step_s,
            "ratio",
            baseline=f"{name} train step",
            goal=0.02,
            **shape,
        )


def _emit(figure: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"figure": figure, "value": round(value, 6), "unit": unit, **extra}), flush=True)


if __name__ == "__main__":
    main()
