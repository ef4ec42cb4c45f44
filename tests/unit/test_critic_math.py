"""GAE, lambda-returns, REINFORCE++ returns, whitening and the value loss against numbers worked by hand."""

import pytest
import torch

from streamrl.learner.critic import gae as G
from streamrl.learner.critic import value_loss as V


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(a, b):
    assert torch.allclose(a, torch.as_tensor(b, dtype=a.dtype), atol=1e-5), (a, b)


def test_gae_one_completion_decoupled_lambdas():
    rewards = G.token_rewards(torch.tensor([1.0]), torch.ones(1, 3))
    close(rewards, [[0.0, 0.0, 1.0]])  # the score at the last token only
    values = t([0.5, 0.6, 0.8])
    adv, ret = G.gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=0.95)
    # t=2: delta = 1 - 0.8 = 0.2, A = 0.2; t=1: delta = 0.8 - 0.6 = 0.2, A = 0.2 + 0.95 x 0.2 = 0.39;
    # t=0: delta = 0.6 - 0.5 = 0.1, A = 0.1 + 0.95 x 0.39 = 0.4705; R = A + V
    close(adv, [[0.4705, 0.39, 0.2]])
    close(ret, [[0.9705, 0.99, 1.0]])
    # lam = 1 (the critic's, VC-PPO): the return of every token is the outcome reward; A = R - V
    adv1, ret1 = G.gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    close(ret1, [[1.0, 1.0, 1.0]])
    close(adv1, [[0.5, 0.4, 0.2]])


def test_gae_skips_positions_off_the_mask():
    # [off, on, env token (off), on, padding]: the last loss token is position 3
    mask = torch.tensor([[0, 1, 0, 1, 0]], dtype=torch.bool)
    rewards = G.token_rewards(torch.tensor([2.0]), mask)
    close(rewards, [[0.0, 0.0, 0.0, 2.0, 0.0]])
    values = t([9.0, 1.0, 9.0, 1.5, 9.0])  # values off the mask never enter
    adv, ret = G.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # t=3: delta = 2 + 0.9 x 0 - 1.5 = 0.5, A = 0.5; t=1 (next loss token is 3): delta = 0.9 x 1.5 - 1.0 = 0.35,
    # A = 0.35 + 0.9 x 0.5 x 0.5 = 0.575
    close(adv, [[0.0, 0.575, 0.0, 0.5, 0.0]])
    close(ret, [[0.0, 1.575, 0.0, 2.0, 0.0]])


def test_gae_one_token_completion_and_a_row_without_loss_tokens():
    mask = torch.tensor([[1, 0], [0, 0]], dtype=torch.bool)
    rewards = G.token_rewards(torch.tensor([0.7, 5.0]), mask)
    close(rewards, [[0.7, 0.0], [0.0, 0.0]])  # the second row has no loss token: no reward lands
    adv, ret = G.gae(rewards, t([0.2, 0.0], [3.0, 3.0]), mask, gamma=0.9, lam=0.9)
    close(adv, [[0.5, 0.0], [0.0, 0.0]])  # 0.7 - 0.2
    close(ret, [[0.7, 0.0], [0.0, 0.0]])


def test_gae_completion_cut_by_max_tokens_is_not_bootstrapped():
    # a completion cut at 2 tokens (finish_reason length) scored 1.0: V after its last token is 0, as an ended one
    adv, ret = G.gae(G.token_rewards(torch.tensor([1.0]), torch.ones(1, 2)), t([0.5, 0.4]), torch.ones(1, 2), 0.9, 0.9)
    # t=1: delta = 1 - 0.4 = 0.6; t=0: delta = 0.9 x 0.4 - 0.5 = -0.14, A = -0.14 + 0.81 x 0.6 = 0.346
    close(adv, [[0.346, 0.6]])
    close(ret, [[0.846, 1.0]])


def test_kl_in_reward_and_discounted_returns():
    mask = torch.ones(1, 3)
    rewards = G.token_rewards(torch.tensor([1.0]), mask, kl=t([0.1, 0.2, 0.3]), kl_coef=0.5)
    close(rewards, [[-0.05, -0.1, 0.85]])  # -0.5 x kl on every token, + 1.0 at the last
    # G2 = 0.85; G1 = -0.1 + 0.5 x 0.85 = 0.325; G0 = -0.05 + 0.5 x 0.325 = 0.1125
    close(G.discounted_returns(rewards, mask, gamma=0.5), [[0.1125, 0.325, 0.85]])


def test_whitening_over_the_batch_however_split():
    x, mask = t([1.0, 2.0, 3.0, 40.0]), torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    # mean 2, unbiased var ((1 - 2)^2 + 0 + (3 - 2)^2) / 2 = 1: [-1, 0, 1], the masked token 0
    close(G.whiten(x, mask, G.moments(x, mask)), [[-1.0, 0.0, 1.0, 0.0]])
    # two parts (micro-batches or ranks): moments summed, then each part whitened alone gives the same
    a, b = (x[:, :2], mask[:, :2]), (x[:, 2:], mask[:, 2:])
    totals = G.moments(*a) + G.moments(*b)
    close(torch.cat([G.whiten(*a, totals), G.whiten(*b, totals)], 1), [[-1.0, 0.0, 1.0, 0.0]])
    # one token: no variance, 0 rather than a division by zero
    close(G.whiten(t([5.0]), torch.ones(1, 1), G.moments(t([5.0]), torch.ones(1, 1))), [[0.0]])


def test_packed_rows_round_trip():
    # two sequences packed: [prompt, prompt->c, c, c] and [prompt, prompt, prompt->c]
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 1], dtype=torch.bool)
    seq_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    cols = G.loss_columns(mask, seq_ids, torch.tensor([0, 4, 7], dtype=torch.int32))
    assert cols.tolist() == [-1, 0, 1, 2, -1, -1, 0]
    rows = G.to_rows(torch.arange(7.0), cols, seq_ids, 2, 3)
    close(rows, [[1.0, 2.0, 3.0], [6.0, 0.0, 0.0]])
    close(G.from_rows(rows, cols, seq_ids), [0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 6.0])


@pytest.mark.parametrize("clip", [0.0, 0.1])
def test_value_loss_clipped_and_not(clip):
    values = torch.tensor([0.5, 0.5, 7.0], requires_grad=True)
    old, returns = torch.tensor([0.8, 0.5, 0.0]), torch.tensor([0.0, 1.0, -9.0])
    mask = torch.tensor([1, 1, 0], dtype=torch.bool)  # the third token is off the mask: never counted
    loss, stats = V.value_loss(values, old, returns, mask, mask.float(), normalizer=2.0, clip=clip)
    loss.backward()
    if clip:
        # token 0: unclipped (0.5 - 0)^2 = 0.25; clipped 0.8 + clamp(-0.3, +-0.1) = 0.7 -> 0.49; max 0.49
        # token 1: (0.5 - 1)^2 = 0.25 both ways. loss = 0.5 x (0.49 + 0.25) / 2 = 0.185
        close(loss.detach(), 0.185)
        assert stats["vf_clipped_sum"].item() == 1.0
        # the clipped branch is flat in V: token 0 gets no gradient; token 1: 0.5 x 2 x (0.5 - 1) / 2 = -0.25
        close(values.grad, [0.0, -0.25, 0.0])
    else:
        close(loss.detach(), 0.125)  # 0.5 x (0.25 + 0.25) / 2
        assert stats["vf_clipped_sum"].item() == 0.0
        close(values.grad, [0.25, -0.25, 0.0])  # 0.5 x 2 x (V - R) / 2
    assert stats["vf_tokens"].item() == 2.0


def test_value_statistics_and_explained_variance():
    old, returns = torch.tensor([0.2, 0.4, 0.9, 5.0]), torch.tensor([0.0, 1.0, 1.0, 5.0])
    mask = torch.tensor([1, 1, 1, 0], dtype=torch.bool)
    out = V.summarize({k: float(v) for k, v in V.value_stats(old, returns, mask).items()})
    # residual R - V = [-0.2, 0.6, 0.1]: mean 1/6, var 0.41/3 - 1/36 = 0.108889; Var(R) = 2/3 - 4/9 = 0.222222
    # explained variance 1 - 0.108889 / 0.222222 = 0.51
    assert out["vf_explained_var"] == pytest.approx(0.51, abs=1e-6)
    assert out["value_mean"] == pytest.approx(0.5)
    assert (out["value_min"], out["value_max"]) == pytest.approx((0.2, 0.9))
    assert out["returns_mean"] == pytest.approx(2 / 3)
    # every return equal: no explained variance to report (not 1 - x / 0)
    flat = V.summarize({k: float(v) for k, v in V.value_stats(old, torch.ones(4), mask).items()})
    assert "vf_explained_var" not in flat and flat["returns_mean"] == 1.0
