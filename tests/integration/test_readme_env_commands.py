"""README's "Bring your environment", as written: each library's commands are read from README.md (so the two
cannot drift) and run in order, in a scratch folder holding a link to the repository's examples/, with the one
change the README documents: `--steps 4` appended to `streamrl run` and `--train-steps 10` to `make-tiny-model`
(CI's time); a `MODEL_DIR` line (a real model's command) is skipped. Each library: every command exits 0,
the run's books balance, and the library's own scoring made the reward (the run's config names the library's
scorer or environment, and every step recorded a reward from it)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from streamrl.engine.config import load
from streamrl.engine.telemetry import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
OVERRIDE = {"run": ["--steps", "4"], "make-tiny-model": ["--train-steps", "10"]}  # README says so
SCORED_BY = {  # what the run's config holds when the library scores it
    "reasoning-gym": ("reward.functions", "streamrl.rollout.envs.reasoning_gym:score"),
    "skyrl-gym": ("env.name", "skyrl_gym"),
    "verifiers": ("reward.functions", "streamrl.rollout.envs.verifiers_tasks:score"),
}


def readme_commands(text: str) -> dict[str, list[str]]:
    """Each library's commands: the indented lines under its `- **name**` bullet of "Bring your environment"."""
    section = text.split("\n## Bring your environment\n", 1)[1].split("\n## ", 1)[0]
    found: dict[str, list[str]] = {}
    library = None
    for line in section.splitlines():
        bullet = re.match(r"- \*\*([\w-]+)\*\*", line)
        if bullet:
            library = found.setdefault(bullet.group(1), [])
        elif library is not None and line.startswith("      ") and line.strip():
            library.append(line.strip())
        elif line and not line.startswith(" "):
            library = None  # the bullet ended
    return found


def command(line: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) for one README line: leading VAR=value settings, then `streamrl ...` or `python ...`."""
    words = shlex.split(line, comments=True)
    env = {**os.environ, "COLUMNS": "200"}
    while re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = os.pathsep.join(p for p in (value, os.environ.get(key, "")) if p) if key == "PYTHONPATH" else value
    program, *args = words
    if program == "streamrl":
        return [sys.executable, "-m", "streamrl", *args, *OVERRIDE.get(args[0], [])], env
    assert program == "python", f"README line {line!r}: the test runs `streamrl ...` and `python ...` lines"
    return [sys.executable, *args], env


def test_the_readme_gives_each_library_commands_that_learn_and_one_for_a_real_model():
    found = readme_commands((ROOT / "README.md").read_text())
    assert set(found) == set(SCORED_BY), found
    for library, lines in found.items():
        runnable = [line for line in lines if "MODEL_DIR" not in line]
        assert any(" run " in f" {line} " for line in runnable), (library, lines)
        assert any("MODEL_DIR" in line for line in lines), (library, lines)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, tuple[list[int], str, list[pathlib.Path]]]:
    """Every library's runnable commands, run in order in its own scratch folder, up to the first that fails:
    (their exit statuses, their output, the run folders)."""
    out = {}
    for library, lines in readme_commands((ROOT / "README.md").read_text()).items():
        cwd = tmp_path_factory.mktemp(library)
        (cwd / "examples").symlink_to(ROOT / "examples")
        codes, said = [], []
        for line in (line for line in lines if "MODEL_DIR" not in line):
            argv, env = command(line)
            proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
            codes.append(proc.returncode)
            said.append(f"$ {line}\n{proc.stdout}{proc.stderr}")
            if proc.returncode:
                break
        runs = sorted((cwd / "runs").iterdir()) if (cwd / "runs").is_dir() else []
        out[library] = (codes, "\n".join(said), runs)
    return out


@pytest.mark.parametrize("library", sorted(SCORED_BY))
def test_a_library_as_the_readme_writes_it(ran, library):
    codes, said, runs = ran[library]
    assert codes and not any(codes), said[-4000:]
    (folder,) = runs
    assert "books balance: " in said and "error:" not in said, said[-3000:]
    field, scorer = SCORED_BY[library]
    section, name = field.split(".")
    value = getattr(getattr(load(folder / "config.toml"), section), name)
    assert value == scorer or scorer in value, (field, value)
    records = read_metrics(folder / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all("reward/mean" in r for r in records)
    if library == "skyrl-gym":  # the environment's own reward, summed over its steps
        assert all(r["env/reward_mean"] == pytest.approx(r["reward/mean"]) for r in records)
    if library != "reasoning-gym":  # a share of letters: never 0 for a whole step, so the scorer saw the replies
        assert max(r["reward/mean"] for r in records) > 0
    print(json.dumps({"library": library, "rewards": [round(r["reward/mean"], 3) for r in records]}))
