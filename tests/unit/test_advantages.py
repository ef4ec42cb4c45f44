import pytest
import torch

from streamrl.learner.advantages import group_advantages

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])


def test_group_mean_centres_and_counts_flat_groups():
    adv, flat = group_advantages(REWARDS, "group_mean")
    # mean of [1, 0, 0, 1] = 0.5 -> [0.5, -0.5, -0.5, 0.5]; [2, 2, 2, 2] has no variance -> zeros
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4]))
    assert flat == 1


def test_group_std_divides_by_unbiased_std():
    adv, flat = group_advantages(REWARDS, "group_std", eps=0.0)
    # unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735; 0.5 / 0.57735 = 0.866025
    assert torch.allclose(adv[0], torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-6)
    assert torch.equal(adv[1], torch.zeros(4))
    assert flat == 1


def test_leave_one_out_subtracts_mean_of_the_others():
    adv, _ = group_advantages(REWARDS, "leave_one_out")
    # r0 = 1, others mean (0 + 0 + 1) / 3 = 1/3 -> 2/3; r1 = 0, others mean 2/3 -> -2/3
    assert torch.allclose(adv[0], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


def test_ragged_groups_keep_their_form_and_singletons_carry_no_signal():
    adv, flat = group_advantages([[3.0], [1.0, 3.0, 5.0]], "group_mean")
    # singleton: no baseline -> 0; [1, 3, 5] - 3 = [-2, 0, 2]
    assert adv == [[0.0], [-2.0, 0.0, 2.0]]
    assert flat == 1


def test_unknown_kind_names_the_choices():
    with pytest.raises(ValueError, match="leave_one_out"):
        group_advantages(REWARDS, "rloo")


def test_batch_std_centres_on_the_group_and_scales_by_the_batch():
    # rewards of the step: 0, 1 | 1, 1, 1 | 2 -> mean 1, squared deviations 1 + 0 + 0 + 0 + 0 + 1 = 2,
    # unbiased std sqrt(2 / 5) = 0.632456; group 0's centred rewards -0.5, 0.5 -> -+0.790569; the flat groups 0
    adv, flat = group_advantages([[0.0, 1.0], [1.0, 1.0, 1.0], [2.0]], "batch_std", eps=0.0)
    assert adv[0] == pytest.approx([-0.790569, 0.790569], abs=1e-6)
    assert adv[1:] == [[0.0, 0.0, 0.0], [0.0]] and flat == 2
    # TRL scale_rewards="batch": (r - group mean) / (std of every reward + eps), the same on a [G, N] tensor
    r = torch.tensor([[0.0, 1.0, 3.0], [2.0, 2.0, 5.0]])
    expected = (r - r.mean(1, keepdim=True)) / (r.reshape(-1).std() + 1e-6)
    assert torch.allclose(group_advantages(r, "batch_std")[0], expected, atol=1e-6)
