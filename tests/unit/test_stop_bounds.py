"""A node's bound on stopping and the launcher's grace, both from the config (never a constant that a
longer `ledger.retry_s` would silently outgrow)."""

from __future__ import annotations

from streamrl.engine.config import build
from streamrl.ops.launcher import stop_grace_s
from streamrl.rollout.service import stop_bound_s


def test_the_launcher_waits_longer_than_a_node_may_take():
    defaults = build({})
    # grace 30 + a send's slice 1 + 2 x ledger.retry_s 30 + closing 20 = 111 s; the launcher: + 10
    assert stop_bound_s(defaults) == 111.0 and stop_grace_s(defaults) == 121.0
    patient = build({}, ["ledger.retry_s=120"])
    # 30 + 1 + 2 x 120 + 20 = 291 s: the launcher's grace follows it
    assert stop_bound_s(patient) == 291.0 and stop_grace_s(patient) == 301.0
