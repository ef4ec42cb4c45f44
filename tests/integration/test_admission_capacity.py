"""The ledger's admission capacity (real Redis) is what sizes a vLLM node, in every run mode: one formula,
`LedgerConfig.admitted_groups`, read by `Ledger.init_run` (through the learner's `claim_run`) and by
engine/placement.py (through `sizing`, the node's engine size)."""

from __future__ import annotations

import pytest

from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.learner.admission import claim_run
from streamrl.rollout.backends.vllm_support import sizing

GROUP_SIZE = 4


# async and auto: (max_staleness 2 + 1) x 3 groups a step = 9; sync: one step's 3 groups
@pytest.mark.parametrize(("mode", "groups"), [("async", 9), ("auto", 9), ("sync", 3)])
def test_the_groups_the_ledger_admits_are_the_groups_a_vllm_node_is_sized_for(redis_url, ledger_run, mode, groups):
    cfg = build({
        "run": {"mode": mode, "steps": 100},
        "ledger": {"max_staleness": 2},
        "learner": {"groups_per_step": 3},
        "rollout": {"backend": "vllm", "group_size": GROUP_SIZE, "gpu_memory_utilization": 0.5},
    })  # fmt: skip
    ledger = Ledger(connect(redis_url), ledger_run, cfg.ledger)
    claim_run(ledger, cfg, resumed_version=None, first_step=1)
    ledger.heartbeat("n")
    granted = sum(ledger.take_credit("n", f"g{i}", GROUP_SIZE, node_version=0) is not None for i in range(groups + 3))
    assert ledger.capacity() == granted == groups  # what the ledger records is what it lets in
    # a vLLM node on a GPU (no device is touched: the sizing reads the config) runs that many groups' sequences
    assert sizing(cfg, "cuda:0", "").max_seqs == groups * GROUP_SIZE
