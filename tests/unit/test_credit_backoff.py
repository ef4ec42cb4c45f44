"""The wait between credit asks of a refused node (rollout/credit_backoff.py), against hand-worked numbers."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamrl.rollout.credit_backoff import CreditBackoff
from streamrl.rollout.ledger_link import LedgerCredits


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


class FakeLedger:
    """Stands in for the ledger's admission (`Ledger.take_credit`): refuses the first `refuse` asks, then grants."""

    def __init__(self, refuse: int):
        self.refuse, self.asks = refuse, 0

    def take_credit(self, node_id, group_id, n, node_version=-1):
        self.asks += 1
        return None if self.asks <= self.refuse else [f"{group_id}:{i}" for i in range(n)]


def test_the_node_credits_wait_between_refused_asks():
    credits = LedgerCredits(FakeLedger(refuse=3), "n0", version_of=lambda: 5)

    async def ask_four_times() -> list[bool]:
        return [await credits.acquire("n0-g0", ["n0-g0:0"]) for _ in range(4)]

    started = time.monotonic()
    assert asyncio.run(ask_four_times()) == [False, False, False, True]
    # waits after refusals 1, 2, 3: 0, 0.02 and 0.04 s, each times a jitter of at least 0.5: >= 0.03 s
    assert time.monotonic() - started >= 0.03
    assert credits.backoff.refusals == 0  # the grant started it over
