"""A rollout node's side of the run's ledger: the credits that admit its groups (`LedgerCredits`) and
the sink that marks each trajectory generated before it goes to the learner (`LedgerSink`)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from streamrl.engine.ledger import Ledger, LedgerError
from streamrl.engine.messages import Trajectory
from streamrl.engine.transport import SendTimeoutError, TrajectorySender, TransportError
from streamrl.rollout.credit_backoff import CreditBackoff

log = logging.getLogger("streamrl.rollout")


class LedgerCredits:
    """Admission through the ledger: one credit per group, returned when the group is resolved."""

    def __init__(self, ledger: Ledger, node_id: str, version_of=lambda: -1):
        """version_of: the policy version the node would generate with now (the ledger's admission
        weighs it against max_staleness, or, in sync mode, against the learner's newest)."""
        self.ledger, self.node_id, self.version_of = ledger, node_id, version_of
        self.backoff = CreditBackoff()  # a refused node asks again less and less often (credit_backoff.py)

    async def acquire(self, group_id: str, sample_ids: list[str]) -> bool:
        n, version = len(sample_ids), self.version_of()
        try:
            taken = await asyncio.to_thread(self.ledger.take_credit, self.node_id, group_id, n, node_version=version)
        except LedgerError as e:
            if "NODE_NOT_ALIVE" not in str(e):
                raise
            # A Redis restarted from its append-only file forgets a heartbeat that expired while it was
            # down; the heartbeat thread beats again within a quarter TTL. Beat now and ask once more.
            log.info("the ledger lost this node's heartbeat (a restarted Redis?); beating again")
            await asyncio.to_thread(self.ledger.heartbeat, self.node_id)
            taken = await asyncio.to_thread(self.ledger.take_credit, self.node_id, group_id, n, node_version=version)
        if taken is None:
            await asyncio.sleep(self.backoff.refused(version))
        else:
            self.backoff.granted()
        return taken is not None

    async def release(self, group_id: str, sample_ids: list[str], reason: str) -> None:
        why = "preempted" if reason == "abandoned" else "generation_error"
        await asyncio.to_thread(self.ledger.drop, sample_ids, why)

    async def drop(self, sample_ids: list[str], reason: str) -> None:
        """Samples of a group that goes on without them (a failed episode), resolved with their reason."""
        await asyncio.to_thread(self.ledger.drop, sample_ids, reason)


class LedgerSink:
    """Marks each trajectory generated in the ledger, then streams it to the learner. A send the learner
    does not take waits in slices (the sender's timeout, rollout/service.py's `SEND_SLICE_S`) up to `send_timeout_s`, so
    `cancel()` (a stop past its grace, a restarted learner) ends it within a slice; a sample not sent
    then stays `generated`, and leaving the ledger resolves it."""

    def __init__(self, ledger: Ledger, sender: TrajectorySender, send_timeout_s: float = 60.0):
        self.ledger, self.sender, self.send_timeout_s = ledger, sender, send_timeout_s
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def send(self, traj: Trajectory) -> int:
        if self.cancelled.is_set():
            return -1
        if not self.ledger.mark_generated([traj])[0]:
            # Not ours any more (reaped as lost while generating, or resolved already): the learner
            # would refuse it, so it is not sent.
            log.warning("sample %s is no longer this node's in the ledger; not sent", traj.sample_id)
            return -1
        deadline = time.monotonic() + self.send_timeout_s
        while not self.cancelled.is_set():
            try:
                return self.sender.send(traj)
            except SendTimeoutError:
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"node {self.sender.node_id}: trajectory {traj.sample_id} not accepted by the learner at "
                        f"{self.sender.addr} within transport.send_timeout_s = {self.send_timeout_s:g}: the learner "
                        "is gone or stopped reading (raise transport.send_timeout_s if it is only slow)"
                    ) from None
        return -1
