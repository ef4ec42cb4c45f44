"""Whether the learner a stopping node serves is gone, so its groups in flight can be resolved at once.

A node told to stop gives its groups in flight `STOP_GRACE_S` (30 s) to reach the learner. When that learner is
gone (killed: the launcher then stops every node) the wait is for nothing, and the launcher's exit waited on it
(issue 52: 33 s after a learner kill). Gone means: the ledger announces another incarnation, or RUN/learner.json
names this incarnation as a process of this machine that no longer runs, or its ledger heartbeat lapsed (a
learner on another host: the cross-host check, a TTL late).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib

from streamrl.engine.ledger import Ledger

log = logging.getLogger("streamrl.rollout")


def learner_gone(ledger: Ledger, incarnation: str, run_dir: pathlib.Path) -> str:
    """Why the learner `incarnation` will take no more groups; '' while it may."""
    try:
        announced = ledger.learner()
        if announced.get("incarnation", incarnation) != incarnation:
            return f"a new learner (incarnation {announced.get('incarnation')}) replaced it"
        gone = process_gone({"incarnation": incarnation}, run_dir)
        if gone:
            return gone
        return "" if ledger.learner_alive() else "its ledger heartbeat lapsed"
    except Exception as e:  # noqa: BLE001 - no answer is no evidence: the grace stands
        log.info("whether the learner is gone could not be read (%s): the stop's grace stands", e)
        return ""


def process_gone(learner: dict, run_dir: pathlib.Path | None) -> str:
    """'the learner process PID is gone' when RUN/learner.json names `learner` (its incarnation, as the ledger
    announces it) as a process of this machine that no longer runs; '' when it runs, ran elsewhere, or nothing
    says (then the heartbeat decides). `streamrl status` says the same of a run's learner."""
    from streamrl.engine.weights.paths import Location, here

    try:
        said = json.loads((run_dir / "learner.json").read_text()) if run_dir is not None else {}
    except (OSError, ValueError):
        return ""
    pid = said.get("pid")
    if not learner or said.get("incarnation") != learner.get("incarnation") or not isinstance(pid, int):
        return ""
    if not here("cpu").same_machine(Location(str(said.get("host")), str(said.get("boot_id")), "cpu")):
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"the learner process {pid} is gone"
    except PermissionError:
        pass  # another user's process holds that pid now, or still: it is not ours to judge
    return ""
