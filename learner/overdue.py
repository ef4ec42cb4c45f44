"""Groups held by a silent node, given up once overdue: a frozen node must not hold the learner's step.

The learner trains groups in their admission order and waits for the oldest (`intake.py`). A node
that froze (SIGSTOP, swapped out, a hung host) holding one of them would hold every step until its
heartbeat expired in the ledger (`ledger.heartbeat_ttl_s`, 15 s by default) and the reaper resolved its
samples; and the credits it holds keep the other nodes from generating in its place. Instead an open
group of which nothing has arrived is given up once both hold:
- it has been open (seen by the learner while waiting) longer than the slowest group measured lately
  (submitted to the engine -> rewarded, on the nodes' clocks) plus `MARGIN_S`: a live node would have
  delivered it;
- the node holding it has been silent on the control channel for `SILENT_S` (it beats every 0.5 s,
  `rollout/control.py`), so a node that is alive but slow is never cut off.
A node whose control connection closed (its process killed: the kernel closes its sockets; the learner's
`Reachability` proves it with a send that fails) cannot deliver anything more: its groups are given up once
that is `GONE_S` old, without the deadline: a kill is acted on one missed beat after it (`reachability.PROBE_AFTER_S`),
not after 2 s of silence and a deadline of seconds. Its frames sent before it died are taken in by then.
Its samples not yet received are dropped as `overdue`, and the step it was admitted for goes on without it:
its place stays empty, its credit held until that step ends (learner/places.py). A node that wakes finds the
samples no longer its own in the ledger and does not send them (`rollout/service.py` `LedgerSink`); if it
stays silent the reaper takes the rest (`node_lost`) once its heartbeat expires.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from streamrl.engine.ledger import Ledger, sample_ids
from streamrl.engine.messages import Trajectory

log = logging.getLogger("streamrl.learner")

SILENT_S = 2.0  # four missed control heartbeats
MARGIN_S = 0.5
GONE_S = 0.1  # the intake drains the trajectory socket every 50 ms: a dead node's last frames are in by then


class OverdueGroups:
    """`measure` every received batch; `give_up` the overdue among the groups the learner waits for.
    `silent_s(node_id)`: seconds since the node was last heard on the control channel (inf: not registered);
    `unreachable_s()`: the nodes whose control connection closed, seconds since (`Reachability.unreachable_s`)."""

    def __init__(
        self,
        ledger: Ledger,
        silent_s: Callable[[str], float],
        window: int,
        unreachable_s: Callable[[], dict[str, float]] = dict,
    ):
        self.ledger, self.silent_s, self.unreachable_s = ledger, silent_s, unreachable_s
        self.durations: collections.deque[float] = collections.deque(maxlen=window)  # the last samples'
        self.waiting: dict[str, float] = {}  # group -> since when it is open with nothing here (learner's clock)
        self.holders: dict[str, str] = {}  # group -> its node, as last read from the ledger
        self.given_up = 0  # groups

    def measure(self, batch: list[Trajectory]) -> None:
        for traj in batch:
            t = traj.timings
            if t.submitted > 0 and t.rewarded >= t.submitted:
                self.durations.append(t.rewarded - t.submitted)

    @property
    def deadline_s(self) -> float | None:
        """How long a group may be waited for (None until a group time was measured)."""
        return max(self.durations) + MARGIN_S if self.durations else None

    def give_up(
        self, open_here_not: list[str], now: float, before: Callable[[str], None] = lambda group: None
    ) -> dict[str, int]:
        """Of the open groups of which nothing has arrived, drop those overdue; group -> samples dropped.
        `before(group)` runs before a group's samples are dropped (their credit returns with them)."""
        self.waiting = {group: self.waiting.get(group, now) for group in open_here_not}
        self.holders = {group: held for group, held in self.holders.items() if group in self.waiting}
        gone = {node for node, seconds in self.unreachable_s().items() if seconds >= GONE_S}
        deadline = self.deadline_s
        if deadline is None and not gone:
            return {}
        dropped: dict[str, int] = {}
        for group, since in self.waiting.items():
            held, waited = self.holders.get(group), now - since
            if not self._due(held, waited, deadline, gone) and (held is not None or not gone):
                continue  # not due, or its node still beats (no ledger read: the usual case)
            record = self.ledger.group(group)  # who holds it now (a re-admitted group changes hands)
            node = self.holders[group] = record.get("node", "")
            if not record or not self._due(node, waited, deadline, gone):
                continue
            before(group)
            n = sum(self.ledger.drop(sample_ids(group, int(record.get("n", 0))), "overdue"))
            why = "its connection closed" if node in gone else f"silent for {self.silent_s(node):.1f} s"
            due = "none measured yet" if deadline is None else f"{deadline:.1f} s"
            log.warning("group %s: node %s %s, the group waited for %.1f s (deadline %s): %d samples dropped as "
                        "overdue", group, node, why, waited, due, n)  # fmt: skip
            dropped[group] = n
        for group in dropped:
            del self.waiting[group]
        self.given_up += len(dropped)
        return dropped

    def _due(self, node: str | None, waited: float, deadline: float | None, gone: set[str]) -> bool:
        """Whether a group its `node` holds (None: not read yet) is given up: the node's connection closed, or
        the group is past its deadline and the node silent."""
        if node in gone:
            return True
        past = deadline is not None and waited >= deadline
        return past and (node is None or self.silent_s(node) >= SILENT_S)
