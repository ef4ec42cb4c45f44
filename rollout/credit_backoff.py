"""How soon a node asks the ledger again for a credit it was refused.

A node refused a credit used to ask again every 10 ms (`node.CREDIT_RETRY_S`) for as long as the refusal
lasted: an idle node cost the ledger a script call and itself a thread hop 100 times a second. At width
that is most of the run's ledger traffic: bench/scale_out.py measured 41 `take_credit` calls per group
admitted at 128 nodes (40 of them refusals) and Redis commands per group growing with N, where the work
per group does not. Credits free in bursts, when the learner commits a step; a node cannot tell when,
but its own weights change right after (the push follows the commit), and in sync mode a credit is
refused until they do. So the wait doubles while refusals last at one version, from nothing (the node's
own 10 ms) up to `CAP_S`, and starts over when the node's version changes or a credit is granted.
Jitter (a factor in [0.5, 1)) keeps the nodes refused together from asking again together.
"""

from __future__ import annotations

import random
from collections.abc import Callable

FIRST_S = 0.02  # the wait after the second refusal in a row; the first is asked again at once
CAP_S = 0.25  # the longest wait: 1,000 idle nodes ask 4,000-8,000 times a second (jittered), not 100,000


class CreditBackoff:
    """Per node: `refused(version)` gives the seconds to wait before asking again; `granted()` resets."""

    def __init__(self, first_s: float = FIRST_S, cap_s: float = CAP_S, jitter: Callable[[], float] | None = None):
        if not 0 < first_s <= cap_s:
            raise ValueError(f"first_s = {first_s:g}, cap_s = {cap_s:g}: need 0 < first_s <= cap_s")
        self.first_s, self.cap_s = first_s, cap_s
        self.jitter = jitter or (lambda: 0.5 + random.random() / 2)
        self.refusals = 0  # in a row, at `seen`
        self.seen: int | None = None  # the node's version at the last refusal (the node's own, read here)

    def refused(self, version: int) -> float:
        """A credit asked with the node at `version` was refused: the seconds to wait before the next ask."""
        if version != self.seen:  # new weights: credits were just freed, or (sync mode) are now ours
            self.refusals, self.seen = 0, version
        self.refusals += 1
        if self.refusals == 1:
            return 0.0
        return min(self.cap_s, self.first_s * 2 ** (self.refusals - 2)) * self.jitter()

    def granted(self) -> None:
        self.refusals = 0
