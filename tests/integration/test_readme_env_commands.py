"""README's "Bring your environment", as written: each library's commands are read from README.md (so the two
cannot drift) and run in order, in a scratch folder holding a link to the repository's examples/, with the one
change the README documents: `--steps 4` appended to `streamrl run` and `--train-steps 10` to `make-tiny-model`
(CI's time); a `MODEL_DIR` line (a real model's command) is skipped. Each library: every command exits 0,
the run's books balance, and the library's own scoring made the reward (the run's config names the library's
scorer or environment, and every step recorded a reward from it). The reasoning-gym run's scorer, built from its
config.toml as its node builds it, also scores a known-right and a known-wrong answer as reasoning-gym does."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from streamrl.bench.first_hour import REAL_MODEL, ROOT, argv, section_commands
from streamrl.engine.config import load
from streamrl.engine.telemetry import read_metrics
from streamrl.rewards.scorer import build_scorer
from streamrl.rollout.sources import read_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

OVERRIDE = {"run": ["--steps", "4"], "make-tiny-model": ["--train-steps", "10"]}  # README says so
SCORED_BY = {  # what the run's config holds when the library scores it
    "reasoning-gym": ("reward.functions", "streamrl.rollout.envs.reasoning_gym:score"),
    "skyrl-gym": ("env.name", "skyrl_gym"),
    "verifiers": ("reward.functions", "streamrl.rollout.envs.verifiers_tasks:score"),
}


def readme_commands() -> dict[str, list[str]]:
    """Each library's command lines, as bench/first_hour.py reads them (the transcript's reading too)."""
    found: dict[str, list[str]] = {}
    for library, line in section_commands((ROOT / "README.md").read_text(), "Bring your environment"):
        found.setdefault(library, []).append(line)
    return found


def test_the_readme_gives_each_library_commands_that_learn_and_one_for_a_real_model():
    found = readme_commands()
    assert set(found) == set(SCORED_BY), found
    for library, lines in found.items():
        runnable = [line for line in lines if REAL_MODEL not in line]
        assert any(" run " in f" {line} " for line in runnable), (library, lines)
        assert any(REAL_MODEL in line for line in lines), (library, lines)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, tuple[list[int], str, list[pathlib.Path]]]:
    """Every library's runnable commands, run in order in its own scratch folder, up to the first that fails:
    (their exit statuses, their output, the run folders)."""
    out = {}
    for library, lines in readme_commands().items():
        cwd = tmp_path_factory.mktemp(library)
        (cwd / "examples").symlink_to(ROOT / "examples")
        codes, said = [], []
        for line in (line for line in lines if REAL_MODEL not in line):
            command, env = argv(line, OVERRIDE)
            proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
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


def test_the_reasoning_gym_runs_reward_is_the_librarys_score(ran):
    """A known-right and a known-wrong completion of the run's first row, scored by the run's own scorer (built
    from its config.toml, as its node builds it) and by reasoning-gym's `score_answer` of the same answers."""
    import reasoning_gym

    (folder,) = ran["reasoning-gym"][2]
    cfg = load(folder / "config.toml")
    row = read_rows(cfg.data.path)[0]  # `reasoning_gym:syllogism`: the rows the node reads
    name, size, seed, index = row["rg_task"]
    dataset = reasoning_gym.create_dataset(name, size=size, seed=seed)
    entry = dataset[index]
    answers = [entry["answer"], f"{entry['answer']}1"]  # right, wrong
    completions = [f"I think so. <answer>{a}</answer>" for a in answers]
    library = [dataset.score_answer(a, entry) for a in answers]
    with build_scorer(cfg.reward, answer_column=cfg.data.answer_column) as scorer:
        ours = scorer.score([row["prompt"]] * 2, completions, [[1], [1]], [row, row])
    assert ours == library and library[0] == 1.0 and library[1] < 1.0, (ours, library)
