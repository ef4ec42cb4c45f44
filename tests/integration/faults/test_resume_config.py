"""A resumed `streamrl run` runs the run's own config (RUN/config.toml, what its first launch ran), not the
command line's defaults: a run started with non-default settings (simulated generation, 6 steps, learner.lr
0.005), stopped by Ctrl-C, resumed as README says (`--resume latest --set run.name=NAME`, in the folder that
holds runs/, nothing else repeated) continues with them to its 6th step; a setting given with --resume applies
on top and is named on the console; one a checkpoint pins (lora.*) is refused with one line naming it.

Simulated generation and training (simulate.gen_s / train_s: the tiny model loads, nothing is sampled), as
test_run_owner.py. On the old code the resume took the demo's settings (30 steps, no simulation, run.dir's
default outside the first run's folder): it failed every test here.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

_spec = importlib.util.spec_from_file_location("ctrl_c", pathlib.Path(__file__).with_name("ctrl_c.py"))
ctrl_c = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ctrl_c)
ctrl_c_after, steps_of = ctrl_c.ctrl_c_after, ctrl_c.steps_of

pytestmark = [pytest.mark.faults, pytest.mark.slow]

NAME = "configured"
FIRST = [*ctrl_c.SIM, f"run.name='{NAME}'", "run.steps=6", "learner.lr=0.005"]


def _streamrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "streamrl", "run", "--rollout-nodes", "1", *args]


def _sets(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The first run stopped by SIGINT after its 2nd step (a clean stop saves a checkpoint); a resume that
    changes lora.enabled (refused), then one that changes learner.lr only, to the run's end. Each command runs
    in `folder`, so run.dir's default (runs) is found without naming it."""
    folder = tmp_path_factory.mktemp("resume-config")
    run_dir = folder / "runs" / NAME
    env = {**os.environ, "COLUMNS": "300"}
    # started as a script's `streamrl run ... &` is, SIGINT ignored: the launcher takes it itself (it ran on to
    # its end before, exit 0; test_run_owner's Ctrl-C is sent to a run started with SIGINT as it comes)
    first = ctrl_c_after(_streamrl(*_sets(FIRST)), run_dir, 2, cwd=folder, as_background_job=True)
    found = dict(first=first, run_dir=run_dir, stopped_at=steps_of(run_dir)[-1])

    def resume(*sets: str):
        args = _streamrl("--resume", "latest", *_sets([f"run.name='{NAME}'", *sets]))
        return subprocess.run(args, cwd=folder, capture_output=True, text=True, env=env, timeout=300)

    found["refused"] = resume("lora.enabled=true")
    found["second"] = resume("learner.lr=0.002")
    found["steps"] = steps_of(run_dir)
    return found


def test_the_resumed_run_continues_with_the_first_runs_settings(resumed):
    code, said = resumed["first"]
    assert code == 130 and resumed["stopped_at"] < 6, said[-2000:]
    second = resumed["second"]
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert resumed["steps"] == list(range(1, 7))  # run.steps = 6 from the first run (the demo's is 30)
    ran = tomllib.loads((resumed["run_dir"] / "config.toml").read_text())  # the learner's --config
    assert ran["run"]["steps"] == 6 and ran["simulate"]["gen_s"] == 0.5 and ran["eval"]["sources"] == []


def test_a_setting_given_with_resume_applies_and_is_named(resumed):
    said = resumed["second"].stdout + resumed["second"].stderr
    assert f"resuming {NAME} from its config.toml" in said, said[-3000:]
    assert "changed on the command line: learner.lr 0.005 -> 0.002" in said, said[-3000:]
    ran = tomllib.loads((resumed["run_dir"] / "config.toml").read_text())
    assert ran["learner"]["lr"] == 0.002


def test_a_field_the_checkpoint_pins_is_refused_naming_it(resumed):
    refused = resumed["refused"]
    assert refused.returncode == 2, (refused.stdout + refused.stderr)[-3000:]
    [line] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "lora.enabled cannot change on a resume" in line, refused.stderr
    assert resumed["steps"][: resumed["stopped_at"]] == list(range(1, resumed["stopped_at"] + 1))
