"""A run that loses and regains a rollout node: throughput per phase and the books at the end.

    python -m streamrl.bench.elastic_run [--device cuda] [--shape 0.5b] [--backend hf] [--steps 8]

Phases: `--nodes` nodes for `--steps` steps; one node stopped (SIGTERM) for `--steps` steps; the
node started again (it must take the current weights before generating) for `--steps` steps.
Then the learner is stopped and the ledger checked. Prints one JSON line per phase and one for
the run (learner step tokens/s and MFU, weight push seconds, ledger counts).
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time

from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.models import SHAPES, make_tiny_model
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher

PEAK_FLOPS = 989e12  # H200 dense bf16


def _records(launcher: Launcher) -> list[dict]:
    return read_metrics(launcher.run_dir / "metrics.jsonl")


def _wait_steps(launcher: Launcher, more: int, timeout_s: float = 600) -> list[dict]:
    target = (_records(launcher) or [{"step": 0}])[-1]["step"] + more
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = _records(launcher)
        if records and records[-1]["step"] >= target:
            return records
        if not launcher.learner.alive:
            raise RuntimeError(f"learner exited:\n{launcher.learner.log_tail(30)}")
        for child in launcher.failed_nodes():
            raise RuntimeError(f"{child.name} exited {child.process.returncode}:\n{child.log_tail(30)}")
        time.sleep(0.5)
    raise RuntimeError(f"step {target} not reached in {timeout_s} s:\n{launcher.learner.log_tail(30)}")


def _phase(name: str, before: list[dict], after: list[dict], nodes: int) -> dict:
    new = after[len(before) :]
    seconds = new[-1]["time"] - (before[-1]["time"] if before else new[0]["time"])
    tokens = sum(r["completion_tokens"] for r in new)
    return {
        "figure": "phase",
        "phase": name,
        "nodes": nodes,
        "steps": len(new),
        "tokens_per_s": tokens / seconds,
        "reward_mean": sum(r["reward/mean"] for r in new) / len(new),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--nodes", type=int, default=2, help="at least 2: one is stopped and restarted")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    if args.nodes < 2:
        parser.error("--nodes must be at least 2: the run must go on while one node is down")
    folder = tempfile.mkdtemp(prefix="srl-elastic-")
    model = make_tiny_model(f"{folder}/model", seed=0, **SHAPES[args.shape])
    cfg = build(
        {},
        [
            f"run.dir='{folder}'",
            "run.name='elastic'",
            "run.steps=100000",
            f"run.device='{args.device}'",
            f"model.path='{model}'",
            f"rollout.backend='{args.backend}'",
            "learner.lr=1e-2",
            "rollout.group_size=8",
            "rollout.max_tokens=24",
            "telemetry.tensorboard=false",
            *args.sets,
        ],
    )
    launcher = Launcher(cfg)
    try:
        launcher.start(args.nodes)
        warm = _wait_steps(launcher, 2)
        full = _wait_steps(launcher, args.steps)
        print(json.dumps(_phase("all nodes", warm, full, args.nodes)))
        launcher.stop_node(f"node-{args.nodes - 1}")
        less = _wait_steps(launcher, args.steps)
        print(json.dumps(_phase("one node stopped", full, less, args.nodes - 1)))
        name, asked = launcher.add_node(), time.monotonic()
        log_path = launcher.run_dir / "logs" / f"rollout-{name}.log"
        while "live on " + name not in (log_path.read_text(errors="replace") if log_path.exists() else ""):
            if time.monotonic() - asked > 600 or launcher.failed_nodes():
                raise RuntimeError(f"{name} never took the current weights:\n{launcher.nodes[name].log_tail(30)}")
            time.sleep(0.5)
        print(json.dumps({"figure": "rejoin_seconds", "node": name, "seconds": time.monotonic() - asked}))
        less = _records(launcher)
        back = _wait_steps(launcher, args.steps)
        print(json.dumps(_phase("node restarted", less, back, args.nodes)))
        launcher.learner.process.send_signal(signal.SIGTERM)
        launcher.learner.process.wait(timeout=120)
        for child in launcher.nodes.values():
            child.process.wait(timeout=60)
        log = (launcher.run_dir / "logs" / f"rollout-{name}.log").read_text(errors="replace")
        ledger = Ledger(connect(launcher.ledger_url), cfg.run.name)
        counts = ledger.counts()
        steady = [r for r in back[2:]]
        positions = sum(r["positions"] for r in steady) / len(steady)
        step_s = sum(r["step_seconds"] for r in steady) / len(steady)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            params = sum(
                p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters()
            )
        print(
            json.dumps(
                {
                    "figure": "run",
                    "device": args.device,
                    "shape": args.shape,
                    "params": params,
                    "learner_tokens_per_s": positions / step_s,
                    "learner_mfu": 6 * params * positions / step_s / PEAK_FLOPS,
                    "weights_push_s": sum(r["weights_s"] for r in steady) / len(steady),
                    "restarted_node_took_weights_first": "live on " + name in log,
                    "trained": counts.trained,
                    "dropped": counts.dropped_by_reason,
                    "in_flight": counts.in_flight,
                    "balance_errors": ledger.check(deep=True),
                }
            )
        )
    finally:
        launcher.stop_all()


if __name__ == "__main__":
    main()
