"""What evaluation during training costs: trained tokens/s with [eval] every N versions against the same run without.

    python -m streamrl.bench.eval_cost [--steps 30] [--every 10] [--nodes 2] [--device cpu] [--config FILE]
        [--max-prompts 32] [--n 1] [--set section.field=value ...]

Runs `streamrl run` twice in this call, one after the other, with the same settings: without [eval] (an empty
one: the demo would evaluate its held-out prompts by default), then with
the demo's held-out prompts (or `--source PATH`) evaluated at version 0, every `--every` versions and the last.
Trained tokens/s is ops/progress.trained_rate over each run's steps (the one definition the live view uses); the
evaluation run's last step includes the wait for the last evaluation, so the figure counts it. Prints one JSON
line (`figure: eval_cost`): both rates, their ratio (with / without), the evaluations made and their pass@1.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

from streamrl.engine.telemetry import read_metrics
from streamrl.ops.progress import trained_rate


def _run(cwd: pathlib.Path, name: str, args: argparse.Namespace, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "streamrl", "run", "--steps", str(args.steps), "--rollout-nodes",
               str(args.nodes), "--device", args.device, "--set", f"run.name='{name}'",
               "--set", "telemetry.tensorboard=false"]  # fmt: skip
    command += ["--config", args.config] if args.config else []
    for override in [*args.set, *extra]:
        command += ["--set", override]
    started = time.monotonic()
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{name}: streamrl run exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}")
    records = read_metrics(cwd / "runs" / name / "metrics.jsonl")
    rate = trained_rate(records)
    evals = [
        {"version": int(r[k.replace("complete", "version")]), "pass@1": r.get(k.replace("complete", "pass@1"))}
        for r in records for k in r if k.startswith("eval/") and k.endswith("/complete")
    ]  # fmt: skip
    return {"tokens_per_s": round(rate.per_s, 1), "tokens": rate.tokens, "learner_s": round(rate.seconds, 1),
            "wall_s": round(wall, 1), "evaluations": evals}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", default="")
    parser.add_argument("--source", default="demo:heldout")
    parser.add_argument("--max-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    evaluation = [f"eval.sources=[{{name='held', path='{args.source}'}}]", f"eval.every={args.every}",
                  f"eval.max_prompts={args.max_prompts}", f"eval.n={args.n}", "eval.pass_threshold=0.5"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="eval-cost-") as tmp:
        without = _run(pathlib.Path(tmp), "without", args, ["eval.sources=[]"])  # the demo evaluates by default
        with_eval = _run(pathlib.Path(tmp), "with", args, evaluation)
    ratio = with_eval["tokens_per_s"] / without["tokens_per_s"] if without["tokens_per_s"] else None
    line = {"figure": "eval_cost", "steps": args.steps, "every": args.every, "nodes": args.nodes,
            "device": args.device, "max_prompts": args.max_prompts, "n": args.n, "config": args.config or "demo",
            "without": without, "with": with_eval, "ratio": round(ratio, 3) if ratio else None}  # fmt: skip
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
