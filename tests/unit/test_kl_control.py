"""The KL-in-reward coefficient's controller (learner/critic/kl_control.py) against numbers worked by hand and
against the update rule of verl / OpenRLHF / TRL written out here; its state through a checkpoint's meta.json;
the config's refusals."""

import random

import msgspec
import pytest
import torch

from streamrl.engine.config import ConfigError, build
from streamrl.engine.config import rules as config_rules
from streamrl.learner.checkpoint.layout import LearnerState
from streamrl.learner.critic.kl_control import KLController, sequence_kl


@pytest.mark.parametrize(
    ("kl", "expected"),
    [
        (0.15, 0.102),  # KL / target - 1 = 0.5, clipped to 0.2: beta x (1 + 0.2 x 8 / 80) = 0.1 x 1.02
        (0.11, 0.101),  # 0.1, inside the clip: 0.1 x (1 + 0.1 x 0.1) = 0.101
        (0.1, 0.1),  # on target: no move
        (0.05, 0.098),  # -0.5, clipped to -0.2: 0.1 x 0.98
        (0.0, 0.098),  # no KL at all: the same largest step down
    ],
)
def test_one_adaptive_update_by_hand(kl, expected):
    c = KLController(0.1, adaptive=True, target=0.1, horizon=80)
    c.update(kl, n_steps=8)
    assert c.value == pytest.approx(expected, rel=1e-12)


def test_the_fixed_coefficient_never_moves_and_is_not_saved():
    c = KLController(0.05)
    c.update(10.0, n_steps=1000)
    assert c.value == 0.05 and c.state_dict() == {"kl_coef": None}
    c.load_state_dict({"kl_coef": 0.7})  # a fixed run takes its config's value, whatever a checkpoint holds
    assert c.value == 0.05


def _verl_rule(value, target, horizon, current, n_steps):
    """The rule of verl's AdaptiveKLController.update (OpenRLHF and TRL have the same), in numpy as they do."""
    import numpy as np

    proportional_error = np.clip(current / target - 1, -0.2, 0.2)
    return value * (1 + proportional_error * n_steps / horizon)


def test_matches_verls_rule_bit_for_bit_over_many_steps():
    rng = random.Random(0)
    c, reference = KLController(0.001, adaptive=True, target=0.1, horizon=10000), 0.001
    for _ in range(500):
        current, n = rng.uniform(0.0, 0.3), rng.randrange(1, 1024)
        c.update(current, n)
        reference = _verl_rule(reference, 0.1, 10000, current, n)
        assert c.value == float(reference)
    assert c.value != 0.001  # it moved (positive control of the equality)


def test_the_coefficient_survives_meta_json_bit_exact():
    c = KLController(0.001, adaptive=True, target=0.05, horizon=7)
    for current in (0.2, 0.01, 0.07, 0.049):
        c.update(current, 3)
    state = LearnerState(step=4, version=4, **c.state_dict())
    back = msgspec.json.decode(msgspec.json.encode(state), type=LearnerState)
    resumed = KLController(0.001, adaptive=True, target=0.05, horizon=7)
    resumed.load_state_dict(back.trainer_state())
    assert resumed.value == c.value and resumed.value != 0.001
    old = msgspec.json.decode(b'{"step": 1, "version": 1}', type=LearnerState)  # a checkpoint from before
    resumed.load_state_dict(old.trainer_state())
    assert resumed.value == c.value  # nothing saved: the controller keeps its start


def test_sequence_kl_is_a_mean_per_completion_then_over_completions():
    # two sequences packed: [prompt, c, c, c] with KL 0.1, 0.2, 0.6 and [prompt, c] with KL 0.4; a third with no
    # loss token (a filler) is not counted
    kl = torch.tensor([9.0, 0.1, 0.2, 0.6, 9.0, 0.4, 9.0])
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)
    seq_ids = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    total, count = sequence_kl(kl, mask, seq_ids, 3).tolist()
    # (0.1 + 0.2 + 0.6) / 3 = 0.3, and 0.4: sum 0.7 over 2 completions (a token mean would be 1.3 / 4 = 0.325)
    assert total == pytest.approx(0.7) and count == 2


def _findings(*overrides):
    return [
        (f.level, f.message)
        for f in config_rules.check(build({}, ["loss.preset='ppo'", "rollout.group_size=1", *overrides]))
    ]


def test_the_config_refuses_a_meaningless_controller_in_one_line():
    [(level, line)] = _findings("critic.kl_ctrl='adaptive'")
    assert level == "error" and line.startswith("critic.kl_ctrl = 'adaptive' with critic.kl_in_reward = 0")
    adaptive = ["critic.kl_in_reward=0.01", "critic.kl_ctrl='adaptive'"]
    with pytest.raises(ConfigError, match=r"kl_target"):
        build({}, [*adaptive, "critic.kl_target=0"])
    with pytest.raises(ConfigError, match=r"kl_horizon"):
        build({}, [*adaptive, "critic.kl_horizon=0"])
    assert _findings(*adaptive, "critic.kl_target=0.02", "critic.kl_horizon=100") == []  # meaningful: accepted
    [(level, line)] = _findings("critic.kl_in_reward=0.01", "critic.kl_target=0.02")  # fixed: nothing reads it
    assert level == "warning" and line.startswith("critic.kl_target set but critic.kl_ctrl = 'fixed'")
