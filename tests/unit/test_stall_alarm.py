"""`StallAlarm`: the time since a sample was last trained, and what became of the samples meanwhile."""

from __future__ import annotations

import logging
import time

import pytest

from streamrl.engine.ledger import Counts
from streamrl.engine.messages import Trajectory
from streamrl.learner.intake import LearnerStalledError, RewardFailingError, RewardWatch, StallAlarm


class FakeBooks:
    """Stands in for the ledger's `counts()` (the run's books in Redis): the counts the test sets."""

    def __init__(self):
        self.counts = Counts(total=10, trained=8, dropped=2, dropped_by_reason={"stale": 2})

    def __call__(self) -> Counts:
        return self.counts


def test_the_alarm_names_the_drops_since_the_last_trained_step_and_stops_past_its_bound(caplog):
    books = FakeBooks()
    alarm = StallAlarm(warn_s=0.05, stop_s=0.3, counts=books)
    # since the baseline: 30 - 10 = 20 admitted; reward_error 15 new, stale 2 -> 4 is 2 new; 3 received
    books.counts = Counts(total=30, trained=8, dropped=19, received=3,
                          dropped_by_reason={"stale": 4, "reward_error": 15})  # fmt: skip
    alarm.check(lambda: "hint")
    assert not caplog.records  # not yet quiet for warn_s
    time.sleep(0.06)
    with caplog.at_level(logging.WARNING, logger="streamrl.learner"):
        alarm.check(lambda: "2 nodes registered")
        alarm.check(lambda: "2 nodes registered")  # once per warn_s, not per call
    assert len(caplog.records) == 1
    assert "since the learner started 20 samples admitted, 17 dropped (reward_error 15, stale 2), 3 received" in (
        caplog.text
    )
    time.sleep(0.25)
    stopped = r"stall_stop_s = 0.3\): since the learner started .*\(reward_error 15"
    with pytest.raises(LearnerStalledError, match=stopped):
        alarm.check(lambda: "hint")


def test_a_trained_step_resets_the_clock_and_the_baseline():
    books = FakeBooks()
    alarm = StallAlarm(warn_s=0.05, stop_s=0.1, counts=books)
    time.sleep(0.08)
    books.counts = Counts(total=14, trained=12, dropped=2, dropped_by_reason={"stale": 2})
    alarm.trained()
    time.sleep(0.08)
    alarm.check(lambda: "")  # 0.08 s since the trained step: under stop_s
    assert alarm.why() == "since the last trained step no sample was admitted or dropped (no node generates)"


def test_stop_zero_never_stops():
    alarm = StallAlarm(warn_s=0.01, stop_s=0.0, counts=FakeBooks())
    time.sleep(0.03)
    alarm.check(lambda: "")


def test_a_stop_bound_below_the_warning_is_refused_naming_both_fields():
    from streamrl.engine.config import ConfigError, build

    with pytest.raises(ConfigError, match=r"learner.stall_stop_s = 50 is below learner.stall_warn_s = 100"):
        build({}, ["learner.stall_warn_s=100", "learner.stall_stop_s=50"])
    assert build({}, ["learner.stall_warn_s=100", "learner.stall_stop_s=0"]).learner.stall_stop_s == 0


def _sample(reward: float | None, error: str = "") -> Trajectory:
    return Trajectory(sample_id="s", group_id="g", node_id="n", seq=0, prompt_ids=[1], completion_ids=[2],
                      behavior_logprobs=[-0.5], reward=reward, policy_version=0, reward_error=error)  # fmt: skip


def test_a_reward_failing_on_nearly_every_sample_of_the_window_stops_the_run_naming_its_first_error():
    watch = RewardWatch(window=40)  # 95% of 40 = 38 failures
    watch.add([_sample(1.0)] * 3 + [_sample(None, "f.py:f: ValueError: boom")] * 36)  # 39 < 40: window not full
    watch.add([_sample(None, "f.py:f: KeyError: later")])  # 40 seen, 37 failed (3 scored): 92.5% < 95%
    assert issubclass(RewardFailingError, LearnerStalledError)  # exit 3, as the stall alarm
    with pytest.raises(RewardFailingError, match=r"failed on 38 of the last 40 samples.*f\.py:f: ValueError: boom"):
        watch.add([_sample(None)])  # the window slides: 2 scored, 38 failed


def test_a_reward_that_fails_now_and_then_never_stops_the_run():
    watch = RewardWatch(window=20)
    for _ in range(50):
        watch.add([_sample(None, "e")] * 18 + [_sample(0.5)] * 2)  # 90% failing: counted, not fatal
    assert list(watch.failed) == [True] * 18 + [False] * 2 and watch.first_error == "e"
    for _ in range(18):  # failures only: the two scored samples stay in the window, 18 of 20 failed
        watch.add([_sample(None, "e")])
    # the positive control: the same watch stops the run once 19 of its 20 failed (95%)
    with pytest.raises(RewardFailingError, match="failed on 19 of the last 20 samples"):
        watch.add([_sample(None, "e")])
