"""Bad input from peers, counted per sender and logged as a summary, never one line per frame.

A peer that sends garbage (a bug, a port scanner, an attack) must cost the receiver neither memory
nor its log: 10k undecodable frames once wrote 10k WARNING lines (1.9 MB). `FaultTally` counts
each kind per sender and writes one WARNING line per sender at most every `interval_s`.
"""

from __future__ import annotations

import collections
import logging
import math
import time

log = logging.getLogger("streamrl.engine.transport")

FAULT_LOG_INTERVAL_S = 60.0

_FAULTS = {"decode_errors": "undecodable frames", "duplicates": "duplicates dropped", "gaps": "messages missing"}


class FaultTally:
    """Bad input counted per sender (a node id, or a peer address when the frame names none).

    One WARNING line per sender at most every `interval_s`: the first fault logs at once with its
    detail, the rest are summed into the next line (`flush_due`, called as the socket is read, and
    `flush` at close), so 10k garbage frames cost two lines, not 10k.
    """

    def __init__(self, where: str, interval_s: float = FAULT_LOG_INTERVAL_S):
        self.where, self.interval_s = where, interval_s
        self.totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self._unlogged: dict[str, collections.Counter] = {}
        self._detail: dict[str, str] = {}  # the first fault's detail since the sender's last line
        self._logged_at: dict[str, float] = {}

    def add(self, sender: str, kind: str, n: int = 1, detail: str = "") -> None:
        self.totals[sender][kind] += n
        self._unlogged.setdefault(sender, collections.Counter())[kind] += n
        self._detail.setdefault(sender, detail)
        if time.monotonic() - self._logged_at.get(sender, -math.inf) >= self.interval_s:
            self._log(sender)

    def count(self, kind: str) -> int:
        # list(): another thread (the gate's, the control thread) may add a sender meanwhile
        return sum(counts[kind] for counts in list(self.totals.values()))

    def by_sender(self) -> dict[str, dict[str, int]]:
        return {sender: dict(counts) for sender, counts in self.totals.items()}

    def flush_due(self) -> None:
        """Log the senders whose interval has passed since their last line."""
        now = time.monotonic()
        for sender in [s for s in self._unlogged if now - self._logged_at.get(s, -math.inf) >= self.interval_s]:
            self._log(sender)

    def flush(self) -> None:
        for sender in list(self._unlogged):
            self._log(sender)

    def _log(self, sender: str) -> None:
        counts, detail = self._unlogged.pop(sender), self._detail.pop(sender, "")
        last = self._logged_at.get(sender)
        self._logged_at[sender] = time.monotonic()
        what = ", ".join(f"{n} {_FAULTS.get(kind, kind)}" for kind, n in counts.items())
        since = f" in the last {time.monotonic() - last:.0f} s" if last is not None else ""
        log.warning("%s: from %s%s: %s%s", self.where, sender, since, what, f" (first: {detail})" if detail else "")
