"""The copies of weight versions a sender keeps while transfers read them: the learner's packed sets
(learner/publisher.py) and a relaying node's copies (engine/weights/relay.py) follow one rule. Each copy counts its
readers; a transfer takes the newest copy if it is newer than what its node has (`take_newer`, held until
`give_back`), so a node that fell behind skips to the newest; the next version is written into a copy no transfer
reads and that is not the newest (`reuse`), so at most one copy a version in flight is kept."""

from __future__ import annotations

import threading
from typing import Generic, Protocol, TypeVar


class Copy(Protocol):
    version: int
    readers: int


C = TypeVar("C", bound=Copy)


class Newest(Generic[C]):
    """The copies, the newest posted last. `cond` is the owner's, where it guards more under the same lock."""

    def __init__(self, cond: threading.Condition | None = None):
        self.cond = cond or threading.Condition()
        self.latest: C | None = None
        self._copies: list[C] = []

    def reuse(self) -> C | None:
        """A copy no transfer reads and not the newest, taken out (its buffers are written next), or None."""
        with self.cond:
            free = next((c for c in self._copies if c.readers == 0 and c is not self.latest), None)
            if free is not None:
                self._copies.remove(free)
            return free

    def post(self, copy: C) -> None:
        """`copy` is the newest: waiting transfers wake to it."""
        with self.cond:
            self._copies.append(copy)
            self.latest = copy
            self.cond.notify_all()

    def take_newer(self, than: int, timeout_s: float) -> C | None:
        """The newest copy if newer than `than` (held until `give_back`), else None after `timeout_s`."""
        with self.cond:
            if self.latest is None or self.latest.version <= than:
                self.cond.wait(timeout_s)
            latest = self.latest
            if latest is None or latest.version <= than:
                return None
            latest.readers += 1
            return latest

    def withdraw(self, copy: C) -> None:
        """`copy` is not to be taken any more (it failed): out of the list; the newest left is the latest."""
        with self.cond:
            if copy in self._copies:
                self._copies.remove(copy)
            if self.latest is copy:
                self.latest = max(self._copies, key=lambda c: c.version, default=None)

    def give_back(self, copy: C) -> None:
        with self.cond:
            copy.readers -= 1

    def wake(self) -> None:
        """Wake the transfers waiting in `take_newer` (one may take the newest now)."""
        with self.cond:
            self.cond.notify_all()
