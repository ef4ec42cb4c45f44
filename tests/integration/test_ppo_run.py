"""One short PPO run read by every test below: the demo on the tiny model with `loss.preset = "ppo"` (a critic,
GAE), one completion per prompt (`rollout.group_size = 1`), one hf node, the critic warming up alone for
its first step; the learner is killed with -9 once its first checkpoint is written (every 2 steps, of 12: it may
have gone on a step or two meanwhile) and resumed with `--resume latest`.

- every step reports the critic's figures; the warm-up step trains the critic alone (no version, its samples
  dropped as no_gradient), the others both;
- the resumed learner goes on from the checkpoint's critic (its step count continues: the critic's state was
  restored, not started again; learner/critic's unit tests assert its weights and AdamW state bit-exact);
- the last checkpoint holds the critic, and `export --critic` writes a value model transformers loads;
- the KL penalty in the reward has an adaptive coefficient (`critic.kl_ctrl = "adaptive"`, a short horizon so
  that it moves a few percent a step): every step's beta is the last one's moved by the controller's rule on
  the last step's KL, across the kill too, so the resumed learner took the checkpoint's beta bit-exact.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import time

import pytest

from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_metrics
from streamrl.learner import checkpoint
from streamrl.ops.launcher import Launcher
from streamrl.ops.naming import TINY

pytestmark = [pytest.mark.slow]
STEPS = 12  # room to kill the learner mid-run: an idle machine runs the tiny steps in ~0.1 s each
COMPLETIONS = 8  # a step's samples: learner.groups_per_step x rollout.group_size
KL_START, KL_TARGET, KL_HORIZON = 0.05, 0.001, 40  # beta moves by up to 0.2 x 8 / 40 = 4% a step


@dataclasses.dataclass
class Run:
    records: list[dict]
    folder: pathlib.Path
    counts: object
    killed: float
    resumed_from: int  # the newest complete checkpoint's step when the learner was killed
    resumed_kl_coef: float  # the adaptive KL coefficient that checkpoint holds (read before it is pruned)


def _wait(launcher: Launcher, done, what: str, timeout_s: float, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return
        assert launcher.learner.alive, f"learner died:\n{launcher.learner.log_tail(40)}"
        time.sleep(poll_s)
    raise AssertionError(f"{what} not reached in {timeout_s} s; learner log:\n{launcher.learner.log_tail(40)}")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    folder = tmp_path_factory.mktemp("ppo")
    settings = [*TINY, f"run.dir='{folder}'", "run.name='ppo'", f"run.steps={STEPS}", "run.device='cpu'"]
    settings += ["loss.preset='ppo'", "rollout.group_size=1", "learner.groups_per_step=8", "rollout.backend='hf'"]
    settings += ["critic.lr=2e-3", "critic.warmup_steps=1", "checkpoint.every=2", "telemetry.tensorboard=false"]
    settings += [f"critic.kl_in_reward={KL_START}", "critic.kl_ctrl='adaptive'", f"critic.kl_target={KL_TARGET}"]
    settings += [f"critic.kl_horizon={KL_HORIZON}"]
    launcher = Launcher(build({}, settings))
    try:
        launcher.start(nodes=1)
        metrics, root = launcher.run_dir / "metrics.jsonl", checkpoint.checkpoints_dir(launcher.run_dir)
        _wait(launcher, lambda: checkpoint.list_checkpoints(root), "the step-2 checkpoint", 600, poll_s=0.05)
        killed = time.time()
        os.kill(launcher.learner.process.pid, signal.SIGKILL)
        launcher.learner.process.wait(timeout=30)
        resumed_from, resumed_path = checkpoint.list_checkpoints(root)[-1]
        resumed_kl_coef = checkpoint.read_meta(resumed_path).state.kl_coef
        assert resumed_from < STEPS, "the learner finished before it was killed: give the run more steps"
        for name in list(launcher.nodes):
            launcher.stop_node(name, timeout_s=60)
        launcher.restart_learner("latest")
        launcher.add_node()
        launcher.learner.process.wait(timeout=600)
        assert launcher.learner.process.returncode == 0, launcher.learner.log_tail(40)
        counts = Ledger(connect(launcher.ledger_url), launcher.cfg.run.name).counts()
        return Run(read_metrics(metrics), launcher.run_dir, counts, killed, resumed_from, resumed_kl_coef)
    finally:
        launcher.stop_all()


def test_every_step_reports_the_critic_and_the_warm_up_trains_it_alone(run):
    by_step = {r["step"]: r for r in run.records}
    assert sorted(by_step) == list(range(1, STEPS + 1)), run.records
    for record in run.records:
        for key in ("critic/vf_loss", "critic/value_mean", "critic/returns_mean", "critic/grad_norm"):
            assert key in record, (key, record)
    assert by_step[1]["skipped"] == 1.0 and by_step[1]["version"] == 0  # the actor waited
    assert all(by_step[s]["skipped"] == 0.0 for s in range(3, STEPS + 1))
    assert by_step[STEPS]["version"] == STEPS - 1
    assert run.counts.in_flight == 0 and run.counts.dropped_by_reason.get("no_gradient", 0) >= 8
    logs = "".join(p.read_text() for p in (run.folder / "logs").glob("learner-rank0*.log"))
    assert logs and "zero reward variance" not in logs  # GAE needs no variance inside a group of one


def test_the_resumed_learner_goes_on_from_the_checkpoints_critic(run):
    after = [r for r in run.records if r["time"] > run.killed]
    assert after and after[0]["step"] == run.resumed_from + 1, (run.resumed_from, run.records)
    meta = checkpoint.read_meta(checkpoint.checkpoints_dir(run.folder) / f"step_{STEPS}")
    assert meta.state.critic_steps == STEPS  # resumed_from before the kill, restored, then the rest
    assert any(name.endswith("score.weight") for name in meta.critic)


def exported_critic(run_dir: pathlib.Path, out: pathlib.Path):
    """`streamrl export RUN OUT --critic` as a user runs it, then the folder loaded by transformers: a one-label
    value model whose head trained away from the zero it started at."""
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForSequenceClassification

    done = subprocess.run([sys.executable, "-m", "streamrl", "export", str(run_dir), str(out), "--critic"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    net = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    assert net.config.num_labels == 1 and torch.count_nonzero(net.score.weight) > 0  # trained from a zero head
    return net


def test_export_critic_of_the_last_checkpoint(run, tmp_path):
    exported_critic(run.folder, tmp_path / "critic")


def test_the_adaptive_kl_coefficient_moves_by_the_rule_and_resumes_bit_exact(run):
    before = {r["step"]: r for r in run.records if r["time"] <= run.killed and r["step"] <= run.resumed_from}
    after = {r["step"]: r for r in run.records if r["time"] > run.killed}
    chain = [{**before, **after}[s] for s in range(1, STEPS + 1)]  # the steps that count: the resumed run's
    assert chain[0]["critic/reward_kl_coef"] == KL_START
    for last, now in zip(chain, chain[1:]):
        # verl's AdaptiveKLController.update(current_kl, n_steps): the float arithmetic the learner does
        error = min(max(last["critic/reward_kl"] / KL_TARGET - 1.0, -0.2), 0.2)
        expected = last["critic/reward_kl_coef"] * (1.0 + error * COMPLETIONS / KL_HORIZON)
        assert now["critic/reward_kl_coef"] == expected, (now["step"], run.resumed_from, chain)
    coefs = [r["critic/reward_kl_coef"] for r in chain]
    assert len(set(coefs)) == STEPS, coefs  # it moved every step (a step on target would not)
    assert after[run.resumed_from + 1]["critic/reward_kl_coef"] == run.resumed_kl_coef  # restored, not restarted
