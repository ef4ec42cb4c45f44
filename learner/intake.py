"""Trajectories in: the PULL socket, admission through the ledger, and group assembly.

Every frame is admitted through the ledger at once (`Ledger.receive`): stale samples, failed
rewards and duplicates are resolved there and never trained. Admitted samples wait here in their
group until the group is whole (or has waited `GROUP_PATIENCE_S`, then it is used with the members
it has); a member that went stale while it waited is dropped when the group is taken, since
staleness is judged at consumption. What is held here is the learner's; `drop_held` resolves it.

`StallAlarm` watches for a run that makes no progress although samples may keep arriving (a reward
that always fails drops every one of them): it counts from the last trained step, not the last
arrival, says what became of the samples meanwhile, and stops the learner past a second bound.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

from streamrl.engine.ledger import Counts, Ledger
from streamrl.engine.messages import Trajectory
from streamrl.engine.telemetry import EventLog
from streamrl.engine.transport import TrajectoryReceiver
from streamrl.learner.overdue import OverdueGroups
from streamrl.learner.places import LostPlaces

log = logging.getLogger("streamrl.learner")

WAITING_WARN_S = 30.0
NO_NODE_WARN_S = 10.0  # ... sooner while no node is registered: the hint then names the command that starts one
GROUP_PATIENCE_S = 30.0  # a group missing members this long is used with the members it has
OPEN_GROUPS_MAX = 4096  # more than any credit capacity: every open group
ARRIVAL_GRACE_S = 2.0  # a group whose first members came this recently is still arriving


class LearnerStalledError(RuntimeError):
    """No sample was trained for `learner.stall_stop_s`; the message says what became of them."""


class StallAlarm:
    """Seconds since a sample was last trained. Past `warn_s` (and every `warn_s` after) it logs why:
    the samples admitted and the drops by reason since then, from the ledger; past `stop_s` (0: never)
    it raises `LearnerStalledError`. A skipped step trains nothing, so it does not reset the clock."""

    def __init__(self, warn_s: float, stop_s: float, counts: Callable[[], Counts]):
        self.warn_s, self.stop_s, self.counts = warn_s, stop_s, counts
        self.trained()
        self.since_what = "since the learner started"

    def trained(self) -> None:
        """A step trained samples just now (one ledger read: the baseline of the next report)."""
        self.since = self.last_warn = time.monotonic()
        self.baseline = self.counts()
        self.since_what = "since the last trained step"

    def check(self, hint: Callable[[], str]) -> None:
        now = time.monotonic()
        quiet = now - self.since
        if self.stop_s and quiet >= self.stop_s:
            raise LearnerStalledError(
                f"no sample trained for {quiet:.0f} s (learner.stall_stop_s = {self.stop_s:g}): {self.why()}; {hint()}"
            )
        if quiet >= self.warn_s and now - self.last_warn >= self.warn_s:
            self.last_warn = now
            log.warning("no sample trained for %.0f s: %s; %s", quiet, self.why(), hint())

    def why(self) -> str:
        """E.g. `since the last trained step 1520 samples admitted, 1488 dropped (reward_error 1488)`."""
        now, base = self.counts(), self.baseline
        drops = {r: n - base.dropped_by_reason.get(r, 0) for r, n in now.dropped_by_reason.items()}
        drops = {r: n for r, n in sorted(drops.items(), key=lambda kv: -kv[1]) if n > 0}
        admitted = now.total - base.total
        if not admitted and not drops:
            return f"{self.since_what} no sample was admitted or dropped (no node generates)"
        reasons = ", ".join(f"{r} {n}" for r, n in drops.items()) or "none"
        return (
            f"{self.since_what} {admitted} samples admitted, {sum(drops.values())} dropped ({reasons}), "
            f"{now.received} received and waiting for their groups"
        )


class RewardFailingError(LearnerStalledError):
    """The reward failed on nearly every sample of a window: nothing can be trained, stop now."""


class RewardWatch:
    """Stops a run whose reward fails on nearly every sample, long before the stall alarm would:
    at least `share` of the last `window` samples received (2 steps' worth of groups) came without a
    reward. A reward that fails now and then is counted (`reward_error` drops) and the run goes on."""

    def __init__(self, window: int, share: float = 0.95):
        self.window, self.share = window, share
        self.failed: collections.deque[bool] = collections.deque(maxlen=window)
        self.first_error = ""

    def add(self, batch: list[Trajectory]) -> None:
        for traj in batch:
            self.failed.append(traj.reward is None)
            if traj.reward is None and not self.first_error:
                self.first_error = traj.reward_error or "no error given by the node"
        failed = sum(self.failed)
        if len(self.failed) == self.window and failed >= self.share * self.window:
            raise RewardFailingError(
                f"the reward failed on {failed} of the last {self.window} samples (2 steps' worth of groups), so "
                f"nothing can be trained; its first error: {self.first_error}"
            )


@dataclasses.dataclass
class _Group:
    first_seen: float
    size: int
    fresh: list[Trajectory] = dataclasses.field(default_factory=list)
    resolved: int = 0  # members dropped or rejected on arrival

    @property
    def complete(self) -> bool:
        return len(self.fresh) + self.resolved >= self.size


class Intake:
    """Receives, admits and assembles groups; `collect` hands out whole groups of fresh samples."""

    def __init__(
        self,
        receiver: TrajectoryReceiver,
        ledger: Ledger,
        alarm: StallAlarm,
        order_patience_s: float = GROUP_PATIENCE_S,
        rewards: RewardWatch | None = None,
        overdue: OverdueGroups | None = None,
        places: LostPlaces | None = None,
    ):
        self.receiver, self.ledger, self.alarm = receiver, ledger, alarm
        self.rewards, self.overdue = rewards, overdue
        self.places = places or LostPlaces(1)  # one group a step: no place is ever left empty
        self.order_patience_s = order_patience_s
        self.groups: dict[str, _Group] = {}
        self.counters = collections.Counter()
        self.events: EventLog | None = None  # the live view's note while the learner waits (RUN/events.jsonl)
        self._order_wait_since: float | None = None

    @property
    def addr(self) -> str:
        return self.receiver.addr

    def collect(
        self,
        n_groups: int,
        version: int,
        between: Callable[[], None],
        waiting_hint: Callable[[], str],
        holding: set[str] = frozenset(),
        warn_after: Callable[[], float] = lambda: WAITING_WARN_S,
        refill: bool = False,
    ) -> list[list[Trajectory]]:
        """Block until `n_groups` whole groups of samples fresh at `version` are here; return them,
        oldest first. `between` runs between receives (node service); `waiting_hint` says what is
        waited for when the wait is longer than `warn_after()` seconds; `holding`: groups this step took
        already (a refill after dynamic sampling dropped some), which the admission order passes over.
        The step's first take goes without the places of its groups given up (`places`), also those given up
        while it waits; a `refill` (after dynamic sampling dropped groups) asks for `n_groups` as counted by
        its caller, the places already taken off (also when it holds none: every group taken was dropped)."""
        waiting_since = last_warn = time.monotonic()
        while True:
            self.alarm.check(waiting_hint)  # also between steps that train nothing (skipped steps)
            between()
            batch = self.drain(0.05)
            if batch:
                self._admit(batch, version)
                waiting_since = last_warn = time.monotonic()
            wanted = n_groups if refill else max(1, n_groups - self.places.short)
            ready = self._take_ready(wanted, version, holding)
            if ready is not None:
                return ready
            if time.monotonic() - last_warn > warn_after():
                note = f"{len(self.groups)} groups partly here; {waiting_hint()}"
                log.warning("waited %.0f s for trajectories: %s", time.monotonic() - waiting_since, note)
                if self.events is not None:
                    self.events.emit("waiting", note=note)
                last_warn = time.monotonic()

    def drain(self, timeout_s: float, limit: int = 4096) -> list[Trajectory]:
        out: list[Trajectory] = []
        first = self.receiver.recv(timeout_s)
        while first is not None and len(out) < limit:
            out.append(first)
            first = self.receiver.recv(0.0)
        return out

    def _admit(self, batch: list[Trajectory], version: int) -> None:
        received = self.ledger.receive(batch, version)
        self.counters.update(
            received=len(received.fresh),
            stale=len(received.stale),
            reward_error=len(received.reward_errors),
            rejected=len(received.rejected),
        )
        fresh_ids = {t.sample_id for t in received.fresh}
        now = time.monotonic()
        for traj in batch:
            group = self.groups.setdefault(traj.group_id, _Group(now, traj.group_size))
            if traj.sample_id in fresh_ids:
                group.fresh.append(traj)
            else:
                group.resolved += 1
        if self.overdue is not None:
            self.overdue.measure(batch)
        if self.rewards is not None:  # once the batch is held here: a stop resolves what it holds
            self.rewards.add(batch)

    def _take_ready(self, n_groups: int, version: int, holding: set[str]) -> list[list[Trajectory]] | None:
        now = time.monotonic()
        ready_ids = [
            g for g, group in self.groups.items() if group.complete or now - group.first_seen > GROUP_PATIENCE_S
        ]
        usable = []
        for group_id in ready_ids:
            if self._fresh_members(self.groups[group_id], version):
                usable.append(group_id)
            else:
                del self.groups[group_id]
        if len(usable) < n_groups:
            self._give_up_overdue(self.ledger.oldest_open_groups(OPEN_GROUPS_MAX), now, holding)  # a silent node's
            return None
        chosen = self._in_admission_order(usable, n_groups, now, holding)
        return None if chosen is None else [self.groups.pop(g).fresh for g in chosen]

    @staticmethod
    def _arriving(group: _Group, now: float) -> bool:
        """Members still coming: a node sends a group's samples one after another."""
        return not group.complete and now - group.first_seen < ARRIVAL_GRACE_S

    def _in_admission_order(
        self, usable: list[str], n_groups: int, now: float, holding: set[str] = frozenset()
    ) -> list[str] | None:
        """The step's groups, oldest admitted first (None: wait for them).

        Admission counted on that order (a group waits as many steps as there were groups before it), so a
        newer group that finished sooner must not take an older one's place: the older one would miss its
        step and go stale. The learner waits for an oldest group of which nothing has arrived yet (it is
        being generated, or its members are arriving), at most `order_patience_s` (a node that died holding
        it is reaped by then), less once the node holding it fell silent (`overdue.py`); a group partly here
        for longer is not waited for (its node died mid-send: the group patience covers it). What is ready
        among the oldest goes first, then the oldest weights."""
        oldest = [g for g in self.ledger.oldest_open_groups(n_groups + len(holding)) if g not in holding]
        ready = set(usable)
        in_flight = [g for g in oldest if g not in self.groups or self._arriving(self.groups[g], now)]
        if in_flight and self._give_up_overdue(self.ledger.oldest_open_groups(OPEN_GROUPS_MAX), now, holding):
            return None  # a silent or gone node's groups, not waited for: look again without their places
        if in_flight:
            if self._order_wait_since is None:
                self._order_wait_since = now
            if now - self._order_wait_since < self.order_patience_s:
                return None
        self._order_wait_since = None
        first = [g for g in oldest if g in ready]
        rest = sorted(ready - set(first), key=lambda g: (min(t.min_version for t in self.groups[g].fresh),
                                                       self.groups[g].first_seen))  # fmt: skip
        return (first + rest)[:n_groups]

    def _give_up_overdue(self, open_groups: list[str], now: float, holding: set[str] = frozenset()) -> set[str]:
        """Drop the open groups (nothing of them here) that a silent node holds past their deadline. `holding`:
        groups this step took already (here no longer, open in the ledger until the step commits): never dropped,
        whatever became of their node (they would be trained as `overdue` and count as a lost place)."""
        if self.overdue is None:
            return set()
        order = list(open_groups)

        def leave_place(group: str) -> None:  # before its credit returns: a group admitted now goes after its step
            if self.places.lose(group, order):
                self.ledger.hold_credits(self.places.held)
            order.remove(group)

        waited = [g for g in open_groups if g not in self.groups and g not in holding]
        given_up = self.overdue.give_up(waited, now, leave_place)
        self.counters.update(overdue=sum(given_up.values()))
        return set(given_up)

    def _fresh_members(self, group: _Group, version: int) -> list[Trajectory]:
        """Drop members that went stale while they waited here: the ledger judges them against the
        version that trains them (`Ledger.drop_stale`, the check that guarantees the bound)."""
        held = len(group.fresh)
        group.fresh = self.ledger.drop_stale(group.fresh, version)
        self.counters.update(stale=held - len(group.fresh))
        return group.fresh

    def forget_sender(self, node_id: str) -> None:
        """A restarted node numbers its messages from 0 again."""
        self.receiver.next_seq.pop(node_id, None)

    def drop_held(self, reason: str) -> int:
        """Resolve every sample received but not handed out (the run ends, or the learner stops)."""
        held = [t.sample_id for group in self.groups.values() for t in group.fresh]
        self.groups.clear()
        return sum(self.ledger.drop(held, reason)) if held else 0

    def close(self) -> None:
        self.receiver.close()
