"""A reward that always returns NaN: every sample is dropped as `reward_error`, nothing is ever trained.

The learner warns every `learner.stall_warn_s` with the drop reasons and counts since the last trained
step, and past `learner.stall_stop_s` stops with exit 3 naming them, instead of running forever.
"""

from __future__ import annotations

import re
import time

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.vllm, pytest.mark.slow]

WARN_S = 10.0
STOP_S = 60.0  # counted from the learner's start: it must cover the node's start-up


def test_an_always_nan_reward_stops_the_run_with_the_reason(fault_run, fault_tools, tmp_path):
    reward = tmp_path / "nan_reward.py"
    reward.write_text("def nan_reward(completions, **kwargs):\n    return [float('nan')] * len(completions)\n")
    sets = [f"reward.functions=['{reward}:nan_reward']", f"learner.stall_warn_s={WARN_S}"]
    run = fault_run([*sets, f"learner.stall_stop_s={STOP_S}", "run.steps=100000"])
    run.launcher.start(nodes=1)
    started = run.launcher.learner.started
    code = run.launcher.learner.process.wait(timeout=STOP_S + 120)
    ran_s = time.time() - started
    log = run.learner_log()
    warnings = re.findall(r"WARNING .*no sample trained for (\d+) s: .*reward_error (\d+)", log)
    stopped = re.search(r"ERROR .*the run stalled: no sample trained for \d+ s .*reward_error (\d+)", log)
    run.launcher.stop_all(keep_redis=True)
    counts = run.ledger.counts()
    books = run.books_at_end(finished=False)
    fault_tools.figure(
        "nan_reward_stall",
        exit_code=code,
        ran_s=round(ran_s, 1),
        warnings=len(warnings),
        reward_error_at_stop=int(stopped.group(1)) if stopped else None,
        **books,
    )
    assert code == 3, run.launcher.learner.log_tail(30)
    assert STOP_S <= ran_s < STOP_S + 60  # the learner's start-up (torch, model) comes on top
    assert warnings and stopped, log[-3000:]
    assert int(stopped.group(1)) > 0 and counts.trained == 0 and not run.records()
