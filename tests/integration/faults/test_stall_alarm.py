"""A reward that always returns NaN, at the default settings: every sample is dropped as `reward_error`
and nothing can ever be trained. The learner stops with exit 3 once 2 steps' worth of groups came
back without a reward (`learner.intake.RewardWatch`), naming the reward and its first error, long
before the stall alarm (`learner.stall_stop_s`, 30 minutes, for runs that are slow but alive)."""

from __future__ import annotations

import re
import time

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.slow]

STOP_S = 60.0  # from the node's first samples to the learner's exit


def test_an_always_nan_reward_stops_the_run_naming_the_reward(fault_run, fault_tools, tmp_path):
    reward = tmp_path / "nan_reward.py"
    reward.write_text("def nan_reward(completions, **kwargs):\n    return [float('nan')] * len(completions)\n")
    run = fault_run([f"reward.functions=['{reward}:nan_reward']", "run.steps=100000", "rollout.backend='hf'"])
    assert run.cfg.learner.stall_stop_s == 1800.0  # the default: the alarm is not what stops this run
    run.launcher.start(nodes=1)
    started = run.launcher.learner.started
    joined = run.wait(lambda: "node node-0 joined" in run.learner_log(), "node joined", 300)
    code = run.launcher.learner.process.wait(timeout=300)
    ended = time.time()
    log = run.learner_log()
    joined_at = fault_tools.log_time(log, "node node-0 joined")
    stopped = re.search(r"ERROR .*the run stops: the reward failed on (\d+) of the last (\d+) samples.*", log)
    run.launcher.stop_all(keep_redis=True)
    counts = run.ledger.counts()
    books = run.books_at_end(finished=False)
    fault_tools.figure("nan_reward_stop", exit_code=code, ran_s=round(ended - started, 1),
                       after_join_s=round(ended - joined_at, 1), **books)  # fmt: skip
    assert joined and code == 3, run.launcher.learner.log_tail(30)
    assert ended - joined_at <= STOP_S
    assert stopped, log[-3000:]
    assert "nan_reward" in stopped.group(0) and "not a finite number" in stopped.group(0)
    assert counts.trained == 0 and not run.records()
