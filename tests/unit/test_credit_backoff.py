"""The wait between credit asks of a refused node (rollout/credit_backoff.py), against hand-worked numbers."""

from __future__ import annotations

import pytest

from streamrl.rollout.credit_backoff import CreditBackoff


def test_waits_double_from_nothing_to_the_cap():
    backoff = CreditBackoff(first_s=0.02, cap_s=0.25, jitter=lambda: 1.0)
    # refusals 1..7 at one version: 0, 0.02, 0.04, 0.08, 0.16, then 0.32 capped at 0.25, 0.25
    assert [backoff.refused(3) for _ in range(7)] == pytest.approx([0.0, 0.02, 0.04, 0.08, 0.16, 0.25, 0.25])


def test_new_weights_or_a_grant_start_over():
    backoff = CreditBackoff(first_s=0.02, cap_s=0.25, jitter=lambda: 1.0)
    for _ in range(5):
        backoff.refused(3)
    assert backoff.refused(4) == 0.0  # the node's version moved: asked again at once
    assert backoff.refused(4) == pytest.approx(0.02)
    backoff.granted()
    assert backoff.refused(4) == 0.0


def test_jitter_scales_the_wait():
    backoff = CreditBackoff(first_s=0.02, cap_s=0.25, jitter=lambda: 0.5)
    backoff.refused(0)
    assert backoff.refused(0) == pytest.approx(0.01)  # 0.02 x 0.5


def test_bad_bounds_name_the_fields():
    with pytest.raises(ValueError, match="first_s = 0.5, cap_s = 0.25"):
        CreditBackoff(first_s=0.5, cap_s=0.25)
