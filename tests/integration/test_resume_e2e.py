"""`kill -9` the learner of a running `streamrl run`, restart it with `--resume latest`.

The run continues from the newest checkpoint to its last step, nothing is trained twice, and the
books balance: what the dead learner had received but not trained is dropped as `preempted`, and
what it trained after the checkpoint is rolled back (the version continues from the checkpoint's).
(tests/integration/faults/test_learner_restart.py does the same with the nodes left running.)
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_ending, read_metrics, write_ending
from streamrl.learner import checkpoint
from streamrl.ops.launcher import Launcher
from streamrl.ops.run import DEMO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
STEPS = 6


def _wait(launcher: Launcher, done, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = done()
        if result:
            return result
        assert launcher.learner.alive, f"learner died:\n{launcher.learner.log_tail(40)}"
        time.sleep(0.5)
    raise AssertionError(f"{what} not reached in {timeout_s} s; learner log:\n{launcher.learner.log_tail(40)}")


def _states(ledger: Ledger) -> dict[str, str]:
    keys = list(ledger.client.scan_iter(match=ledger.prefix + "s:*", count=1000))
    pipe = ledger.client.pipeline()
    for key in keys:
        pipe.hget(key, "state")
    return {k.removeprefix(ledger.prefix + "s:"): s for k, s in zip(keys, pipe.execute())}


@pytest.fixture(params=["full", "lora"])
def launcher(tmp_path, request):
    """The demo; `lora`: with rank-8 adapters (checkpoints and exports hold the adapters alone), on hf nodes."""
    # lora: hf nodes (adapter pushes into vLLM are test_lora_push's; what is tested here is the learner's resume)
    lora = ["lora.enabled=true", "lora.rank=8", "rollout.backend='hf'"] if request.param == "lora" else []
    cfg = build(
        {},
        [
            *DEMO,
            f"run.dir='{tmp_path}'",
            "run.name='resume'",
            f"run.steps={STEPS}",
            "run.device='cpu'",
            "telemetry.tensorboard=false",
            "checkpoint.every=2",
            "checkpoint.export_every=3",
            "ledger.heartbeat_ttl_s=4.0",
            *lora,
        ],
    )
    launcher = Launcher(cfg)
    yield launcher
    launcher.stop_all()


def _resume(launcher: Launcher, metrics, killed: float) -> None:
    """The learner restarted from its latest checkpoint, with a node, run to its end. How an earlier life of
    the run ended (a learner killed with -9 writes nothing, so one is written here) is gone while it runs
    (`streamrl status`: running), and its own ending is written when it finishes."""
    write_ending(launcher.run_dir, "stopped by the stall alarm", 3, "an earlier ending")
    assert read_ending(launcher.run_dir) is not None  # the positive control
    launcher.restart_learner("latest")
    launcher.add_node()
    _wait(launcher, lambda: read_metrics(metrics)[-1]["time"] > killed, "a step of the resumed learner", 600)
    # gone once it trains; when its last steps came within one poll, it may have written its own ending already
    ending = read_ending(launcher.run_dir)
    assert ending is None or (ending["ended"], ending["exit"]) == ("finished", 0), ending
    launcher.learner.process.wait(timeout=600)
    assert launcher.learner.process.returncode == 0, launcher.learner.log_tail(40)
    assert read_ending(launcher.run_dir)["exit"] == 0


def test_learner_killed_and_resumed(launcher):
    from transformers import AutoModelForCausalLM

    launcher.start(nodes=1)
    metrics = launcher.run_dir / "metrics.jsonl"
    root = checkpoint.checkpoints_dir(launcher.run_dir)
    _wait(
        launcher,
        lambda: checkpoint.list_checkpoints(root) and read_metrics(metrics)[-1]["step"] >= 3,
        "a checkpoint and step 3",
        600,
    )
    killed = time.time()
    os.kill(launcher.learner.process.pid, signal.SIGKILL)
    launcher.learner.process.wait(timeout=30)
    ledger = Ledger(connect(launcher.ledger_url), launcher.cfg.run.name)
    at_death = _states(ledger)
    received_at_death = {s for s, state in at_death.items() if state == "received"}
    trained_at_death = sum(state == "trained" for state in at_death.values())
    version_at_death = ledger.current_version()  # a step may have committed without its metrics line
    for name in list(launcher.nodes):  # the old nodes cannot reach a new learner: they leave the ledger
        launcher.stop_node(name, timeout_s=60)
    resumed_from = checkpoint.list_checkpoints(root)[-1][0]

    _resume(launcher, metrics, killed)
    for child in launcher.nodes.values():
        child.process.wait(timeout=60)

    records = read_metrics(metrics)
    after = [r for r in records if r["time"] > killed]
    resumed_version = next(r["version"] for r in records if r["step"] == resumed_from)
    assert [r["step"] for r in after] == list(range(resumed_from + 1, STEPS + 1)), records
    # the version continues at the checkpoint's (a step without gradient, all its groups flat, moves none)
    assert after[0]["version"] == resumed_version + 1 - after[0]["skipped"]
    assert all(r["skipped_nonfinite"] == 0 for r in records)
    counts = ledger.counts()
    assert ledger.check(deep=True) == [] and counts.in_flight == 0, (ledger.check(deep=True), counts)
    # the resumed learner's samples were each trained now, none a second time; those trained after the
    # checkpoint by the dead learner were rolled back
    rolled_back = counts.dropped_by_reason.get("rolled_back", 0)
    rollbacks = ledger.rollbacks()  # none when the learner died before a step past the checkpoint committed
    assert bool(rollbacks) == (version_at_death > resumed_version), (rollbacks, version_at_death, resumed_version)
    recorded = rollbacks[-1]["samples"] if rollbacks else 0
    assert rolled_back == after[0].get("resume/rolled_back_samples", 0) == recorded
    undone = [i for i, s in _states(ledger).items() if s == "dropped:rolled_back" and ledger.record(i).get("v_trn")]
    trained_then = trained_at_death - len(undone)
    assert trained_then + sum(r["samples"] for r in after) == counts.trained, (counts, after)
    states = _states(ledger)
    assert all(states[s] == "dropped:preempted" for s in received_at_death), received_at_death
    print(
        json.dumps(
            {
                "resumed_from": resumed_from,
                "version_at_death": version_at_death,
                "trained": counts.trained,
                "dropped": counts.dropped_by_reason,
                "received_at_death": len(received_at_death),
            }
        )
    )

    assert [s for s, _ in checkpoint.list_checkpoints(root)][-1] == STEPS
    from streamrl.learner.checkpoint import load_weights as load_checkpoint_weights

    final = load_checkpoint_weights(root / f"step_{STEPS}")
    if launcher.cfg.lora.enabled:  # a PEFT adapter folder of the adapters the checkpoint holds
        from safetensors.torch import load_file

        from streamrl.engine.lora import wire_name

        adapter = load_file(launcher.run_dir / "exports" / f"step_{STEPS}" / "adapter_model.safetensors")
        assert adapter.keys() == {wire_name(k) for k in final} and len(final) == 2 * 7 * 2  # A, B x 7 x 2 layers
        assert all((adapter[wire_name(k)] == v).all() for k, v in final.items())
        return
    exported = AutoModelForCausalLM.from_pretrained(launcher.run_dir / "exports" / f"step_{STEPS}")
    assert all((v == final[k]).all() for k, v in exported.state_dict().items())
