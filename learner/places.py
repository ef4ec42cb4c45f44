"""The places of groups given up in the steps they were admitted for: those steps train the groups they have.

Admission gives each group a place in the steps to come: the learner trains groups in their admission order,
`groups_per_step` a step, and the ledger admits a group only when its place is within `max_staleness` of the
weights that generate it (take_credit.lua). When the learner gives up a group (its node was killed, or froze:
learner/overdue.py), the group's place would be filled by the next group in that order, and a new group
admitted at the back. But the next group was admitted for a later step and may have barely started, and the
steps behind it then wait for groups begun only now: after a kill the learner waited for generation from
scratch (up to 2.4 step times at the defaults, where a group takes longer to make than a step to train).

Instead the place stays empty: its step trains the groups it has, and the credit stays held in the ledger
(`Ledger.hold_credits`) until that step ends, so the group admitted in its stead is placed after it (and judged
against the staleness bound at that place, not an earlier one). What it costs: that step trains fewer groups
(a smaller batch, its gradient noisier), and the lost samples are not made up in it; nothing is generated twice
and no sample is trained staler than before. A step keeps one group at least: a step that lost every group
but one gives the further places back (the next groups fill them, as before).
"""

from __future__ import annotations

import collections


class LostPlaces:
    """Empty places per step ahead (0: the step being collected); `lose` a given-up group, `step_done` at each
    step's end. `held` is what the ledger must keep taken (`Ledger.hold_credits`)."""

    def __init__(self, groups_per_step: int):
        self.per_step = groups_per_step
        self.empty: collections.Counter[int] = collections.Counter()  # steps ahead -> places left empty

    @property
    def held(self) -> int:
        return sum(self.empty.values())

    @property
    def short(self) -> int:
        """Groups the step being collected goes without."""
        return self.empty[0]

    def step_of(self, group: str, order: list[str]) -> int | None:
        """Which step ahead trains `group`, given every open group in admission order (None: not among them)."""
        step, room = 0, self.per_step - self.empty[0]
        for other in order:
            while room <= 0:
                step += 1
                room = self.per_step - self.empty[step]
            if other == group:
                return step
            room -= 1
        return None

    def lose(self, group: str, order: list[str]) -> bool:
        """`group` (in `order`, every open group by admission) is given up: its place stays empty. False when its
        step would be left without a group (the place is given back) or it is not in `order`."""
        step = self.step_of(group, order)
        if step is None or self.empty[step] + 1 >= self.per_step:
            return False
        self.empty[step] += 1
        return True

    def step_done(self) -> int:
        """The step being collected ended (trained or skipped): its empty places are gone; the credits still held."""
        self.empty = collections.Counter({step - 1: n for step, n in self.empty.items() if step > 0 and n})
        return self.held
