"""The learner's heartbeat in the ledger, from a thread of its own (a step may outlast a TTL)."""

from __future__ import annotations

import logging
import threading

from streamrl.engine.ledger import Ledger

log = logging.getLogger("streamrl.learner")


class LearnerHeartbeat(threading.Thread):
    """Beats for learner `incarnation` every quarter `ledger.heartbeat_ttl_s` (`Ledger.learner_heartbeat`), so
    `streamrl status` tells a live learner from one gone without an ending (killed, its host lost)."""

    def __init__(self, ledger: Ledger, incarnation: str):
        super().__init__(name="learner-heartbeat", daemon=True)
        self.ledger, self.incarnation = ledger, incarnation
        self.period_s = ledger.config.heartbeat_ttl_s / 4
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.ledger.learner_heartbeat(self.incarnation)
            except Exception as e:  # noqa: BLE001 - the loop meets a lost ledger itself and says so
                log.debug("learner heartbeat failed: %s", e)
            self.stopping.wait(self.period_s)

    def stop(self) -> None:
        """No beat after this: the heartbeat expires within a TTL (a finished run says so in the ledger)."""
        self.stopping.set()
        self.join(timeout=1.0)
