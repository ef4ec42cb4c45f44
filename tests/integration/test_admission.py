"""The ledger's admission rules (real Redis): no group starts that cannot be trained within max_staleness,
sync mode admits one step's groups generated with the newest weights, and nothing beyond the run's end."""

from __future__ import annotations

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect


def _ledger(redis_url, run, staleness, mode="async", steps_left=-1, per_step=2) -> Ledger:
    ledger = Ledger(connect(redis_url), run, LedgerConfig(max_staleness=staleness))
    ledger.init_run(groups_per_step=per_step, mode=mode, steps_left=steps_left)
    ledger.heartbeat("n")
    return ledger


def _take(ledger: Ledger, count: int, version: int, start: int = 0) -> int:
    return sum(ledger.take_credit("n", f"g{start + i}", 1, node_version=version) is not None for i in range(count))


def _resolve_all(ledger: Ledger, groups: range) -> None:
    ledger.drop([f"g{i}:0" for i in groups], "preempted")


def test_async_admits_what_can_be_trained_within_max_staleness(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run, staleness=1)
    # current version 0, node at 0: a group waits floor(q / 2) steps; q = 0..3 give 0, 0, 1, 1 <= 1
    assert _take(ledger, 6, version=0) == 4
    _resolve_all(ledger, range(4))
    ledger.publish_version(1, step=1)
    # the node lags one version: floor(q / 2) + 1 <= 1 only while q < 2
    assert _take(ledger, 6, version=0, start=10) == 2
    # without a version (an old node), only the capacity (max_staleness + 1) * per_step = 4 applies
    assert _take(ledger, 6, version=-1, start=20) == 2
    _resolve_all(ledger, [*range(10, 12), *range(20, 22)])


def test_sync_admits_one_step_of_groups_with_the_newest_weights(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run, staleness=3, mode="sync")
    assert _take(ledger, 5, version=0) == 2  # one step: groups_per_step, whatever max_staleness says
    _resolve_all(ledger, range(2))
    ledger.publish_version(1, step=1)
    assert _take(ledger, 3, version=0, start=10) == 0  # old weights: nothing until the node has version 1
    assert _take(ledger, 3, version=1, start=20) == 2
    _resolve_all(ledger, range(20, 22))


def test_no_group_beyond_what_the_remaining_steps_train(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run, staleness=4, steps_left=1)
    assert _take(ledger, 8, version=0) == 2  # one step left: its two groups, not (4 + 1) * 2
    ledger.commit_step([f"g{i}:0" for i in range(2)], version=1, step=1, steps_left=0)
    assert _take(ledger, 4, version=1, start=10) == 0  # the run is done: no more groups


def test_a_step_without_an_update_drops_its_samples_keeps_the_version_and_counts_as_done(redis_url, ledger_run):
    ledger = _ledger(redis_url, ledger_run, staleness=4, steps_left=2)
    assert _take(ledger, 8, version=0) == 4  # two steps left: their four groups
    ledger.skip_step({"no_gradient": ["g0:0", "g1:0"]}, steps_left=1)
    counts = ledger.counts()
    assert counts.dropped_by_reason == {"no_gradient": 2} and counts.trained == 0
    assert ledger.current_version() == 0  # no update, no version
    # the skipped step is done: one step left, whose two groups are in flight; nothing more is admitted
    assert _take(ledger, 4, version=0, start=10) == 0
    _resolve_all(ledger, range(2, 4))


def test_commit_step_drops_the_samples_the_step_left_out_with_the_commit(redis_url, ledger_run):
    """Truncated completions are dropped in the commit's round trip, after steps_left is written (so a credit
    they return is weighed against the steps now left; the order itself is a race this test cannot stage)."""
    ledger = _ledger(redis_url, ledger_run, staleness=4, steps_left=1)
    assert _take(ledger, 4, version=0) == 2
    ledger.transition(["g0:0"], "generated", [(0, 0, "n")])
    assert ledger.mark_received(["g0:0"]) == [True]
    # g0 trained, g1 wholly truncated: both resolved by the one call; the run is done, nothing is admitted
    assert ledger.commit_step(["g0:0"], 1, 1, steps_left=0, dropped={"truncated": ["g1:0"]}) == [True]
    counts = ledger.counts()
    assert counts.dropped_by_reason == {"truncated": 1} and counts.trained == 1 and counts.in_flight == 0
    assert ledger.current_version() == 1 and _take(ledger, 4, version=1, start=10) == 0
