"""The MFU's FLOPs count the critic: its values for GAE and each of its passes, a LoRA critic's frozen base at 4 FLOPs a
parameter a token (learner/main.py)."""

from __future__ import annotations

import types

from torch import nn

from streamrl.engine.config import build
from streamrl.learner.main import _critic_flops


def _trainer(model: nn.Module | None):
    return types.SimpleNamespace(shaper=types.SimpleNamespace(model=model) if model is not None else None)


def test_critic_flops_count_the_values_and_each_pass():
    critic = nn.Linear(10, 10)  # 110 parameters
    cfg = build({}, ["loss.preset='ppo'", "critic.epochs=3"])
    assert _critic_flops(cfg, _trainer(critic)) == (2 + 6 * 3) * 110


def test_critic_flops_take_the_actors_epochs_when_the_critics_are_unset():
    cfg = build({}, ["loss.preset='ppo'", "critic.epochs=0", "learner.epochs=2"])
    assert _critic_flops(cfg, _trainer(nn.Linear(4, 1))) == (2 + 6 * 2) * 5


def test_a_lora_critics_frozen_base_costs_its_forward_and_input_gradients():
    critic = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 1))  # 110 frozen, 11 trained
    critic[0].requires_grad_(False)
    cfg = build({}, ["loss.preset='ppo'", "critic.epochs=2"])
    assert _critic_flops(cfg, _trainer(critic)) == 2 * 121 + 2 * (4 * 110 + 6 * 11)


def test_no_critic_no_flops():
    cfg = build({}, [])
    assert _critic_flops(cfg, _trainer(None)) == 0
    assert _critic_flops(cfg, types.SimpleNamespace(shaper=types.SimpleNamespace(model=None))) == 0
