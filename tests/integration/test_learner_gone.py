"""A stopping node skips the 30 s grace only when the learner it serves is gone (rollout/learner_gone.py), judged
from a real ledger and RUN/learner.json: a new incarnation announced, its process gone on this machine, or its
heartbeat lapsed; a live learner keeps the grace."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.weights.paths import boot_id
from streamrl.rollout.learner_gone import learner_gone


def test_the_grace_is_skipped_only_for_a_learner_that_is_gone(redis_url, ledger_run, tmp_path):
    ledger = Ledger(connect(redis_url), ledger_run, LedgerConfig(heartbeat_ttl_s=30.0))
    ledger.announce_learner("first", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    ledger.learner_heartbeat("first")
    record = {"incarnation": "first", "pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id()}
    (tmp_path / "learner.json").write_text(json.dumps(record))
    assert learner_gone(ledger, "first", tmp_path) == ""  # alive, beating: the control

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "learner.json").write_text(json.dumps({**record, "pid": dead.pid}))
    assert learner_gone(ledger, "first", tmp_path) == f"the learner process {dead.pid} is gone"  # beat not lapsed yet

    (tmp_path / "learner.json").write_text(json.dumps({**record, "boot_id": "another host"}))
    ledger.client.delete(ledger.prefix + "learner:alive")  # its heartbeat lapsed (a learner on another host)
    assert learner_gone(ledger, "first", tmp_path) == "its ledger heartbeat lapsed"

    ledger.announce_learner("second", "tcp://127.0.0.1:3", "tcp://127.0.0.1:4")
    assert learner_gone(ledger, "first", tmp_path).startswith("a new learner (incarnation second)")
