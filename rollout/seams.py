"""What the rollout node loop (rollout/node.py) is handed, and what it counts.

The end-to-end wiring (rollout/service.py) fills the seams: `Credits` (admission through the ledger;
unlimited by default), a `TrajectorySink` (the ZMQ sender to the learner) and a `Scorer` (the reward
functions' pool). Tests pass stand-ins for each; `NodeStats` is what a run of the loop returns.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from streamrl.engine.messages import Trajectory


class Credits(Protocol):
    """Admission: a group starts only once `acquire` granted it; `release` returns a group never sent;
    `drop` resolves single samples never sent as `dropped:<reason>` (`reason` is a ledger drop reason,
    lowercase letters, digits and '_'), the group's other samples going on."""

    async def acquire(self, group_id: str, sample_ids: list[str]) -> bool: ...

    async def release(self, group_id: str, sample_ids: list[str], reason: str) -> None: ...

    async def drop(self, sample_ids: list[str], reason: str) -> None: ...


class UnlimitedCredits:
    async def acquire(self, group_id: str, sample_ids: list[str]) -> bool:
        return True

    async def release(self, group_id: str, sample_ids: list[str], reason: str) -> None:
        return None

    async def drop(self, sample_ids: list[str], reason: str) -> None:
        return None


class TrajectorySink(Protocol):
    def send(self, traj: Trajectory) -> int: ...


class Scorer(Protocol):
    def score(
        self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], columns: list[dict]
    ) -> list[float | None]: ...


@dataclasses.dataclass
class NodeStats:
    groups_started: int = 0
    groups_sent: int = 0
    samples_sent: int = 0
    tokens_sent: int = 0
    groups_failed: int = 0  # generation or scoring raised; the group's credit was released
    rewards_none: int = 0
    abandoned: list[str] = dataclasses.field(default_factory=list)  # group ids cut off by stop()
    weight_updates: int = 0
    episodes_dropped: dict[str, int] = dataclasses.field(default_factory=dict)  # by reason (env mode)
    episode_limits: dict[str, int] = dataclasses.field(default_factory=dict)  # episodes/turns cut by each limit
    sleeps: int = 0  # times the engine slept while the learner trained (sync mode, the learner's device)
