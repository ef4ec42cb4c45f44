"""The ledger's pure rules: staleness, the balance equation, ids, reasons, URL redaction."""

import pytest

from streamrl.engine.ledger import Counts, is_stale, sample_ids
from streamrl.engine.ledger.books import check_reason
from streamrl.engine.redis_server import redact


@pytest.mark.parametrize(
    "sample, current, bound, stale",
    [
        (5, 5, 0, False),  # lag 0 <= 0
        (4, 5, 0, True),  # lag 1 > 0
        (4, 5, 1, False),  # lag 1 <= 1: the off-policy bound allows one version behind
        (3, 5, 1, True),  # lag 2 > 1
        (2, 5, 3, False),  # lag 3 <= 3
    ],
)
def test_is_stale_counts_versions_behind(sample, current, bound, stale):
    assert is_stale(sample, current, bound) is stale


def test_balanced_counts_have_no_errors():
    # total 10 = trained 4 + dropped 3 + in flight (1 + 1 + 1)
    counts = Counts(
        total=10,
        admitted=1,
        generated=1,
        received=1,
        trained=4,
        dropped=3,
        dropped_by_reason={"stale": 2, "node_lost": 1},
    )
    assert counts.in_flight == 3
    assert counts.balance_errors() == []


def test_unbalanced_counts_name_the_equation():
    # total 10 but 4 + 3 + 2 = 9: one sample vanished
    counts = Counts(total=10, admitted=1, generated=1, trained=4, dropped=3, dropped_by_reason={"stale": 3})
    (error,) = counts.balance_errors()
    assert "total 10 != trained 4 + dropped 3 + in flight 2" in error


def test_dropped_must_equal_the_sum_over_reasons():
    counts = Counts(total=3, dropped=3, dropped_by_reason={"stale": 1, "overlong": 1})
    assert counts.balance_errors() == ["dropped 3 != sum over reasons 2"]


def test_sample_ids_of_a_group():
    assert sample_ids("n0-7", 3) == ["n0-7:0", "n0-7:1", "n0-7:2"]


def test_drop_reason_must_be_a_plain_word():
    assert check_reason("reward_error") == "reward_error"
    with pytest.raises(ValueError, match="drop reason 'Bad reason'"):
        check_reason("Bad reason")


def test_redact_hides_only_the_password():
    assert redact("redis://:s3cret@host:6380/1") == "redis://:***@host:6380/1"
    assert redact("rediss://user:pw@h:6379") == "rediss://user:***@h:6379"
    assert redact("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
