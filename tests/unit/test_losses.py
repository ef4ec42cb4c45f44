"""Every loss variant against numbers worked by hand (arithmetic in the comments)."""

import math

import pytest
import torch

from streamrl.engine.config import LossConfig
from streamrl.learner.losses import policy_loss, summarize


def cfg(**kw) -> LossConfig:
    return LossConfig(**kw)


def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_ppo_clip_higher_against_behavior():
    lp = leaf([-1.0, -1.0, -1.0, -1.0])
    mu = torch.tensor([-1.1, -1.5, -0.5, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = policy_loss(lp, mu, adv, mask, cfg(importance="none", clip_low=0.2, clip_high=0.28))
    # r = exp(lp - mu) = [exp(.1)=1.10517, exp(.5)=1.64872, exp(-.5)=0.60653, 1]
    # t0: A=1, r inside [0.8, 1.28] -> -1.10517
    # t1: A=1, r > 1.28 -> clipped -1.28 (a symmetric 0.2 clip would give -1.2)
    # t2: A=-1, r < 0.8 -> clipped 0.8
    # t3: A=-1, r=1 -> 1
    # mean = (-1.10517 - 1.28 + 0.8 + 1) / 4 = -0.146293
    assert loss.item() == pytest.approx(-0.146293, abs=1e-6)
    loss.backward()
    # clipped tokens get no gradient; d/dlp of -r A / 4 = -r A / 4
    assert lp.grad.tolist() == pytest.approx([-1.10517 / 4, 0.0, 0.0, 0.25], abs=1e-5)
    assert summarize({k: v.item() for k, v in stats.items()})["clip_fraction"] == 0.5


def test_dual_clip_bounds_negative_advantages():
    lp = leaf([math.log(5.0) - 1.0])
    mu = torch.tensor([-1.0], dtype=torch.float64)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.ones(1, dtype=torch.bool)
    # r = 5, A = -1: max(-rA, -clip(r)A) = max(5, 1.28) = 5
    plain, _ = policy_loss(lp, mu, adv, mask, cfg(importance="none"))
    assert plain.item() == pytest.approx(5.0)
    # dual clip c = 3: min(5, -c A = 3) = 3, and no gradient through the bound
    dual, stats = policy_loss(lp, mu, adv, mask, cfg(importance="none", dual_clip=3.0))
    assert dual.item() == pytest.approx(3.0)
    dual.backward()
    assert lp.grad.item() == 0.0
    assert stats["clipped_sum"].item() == 1.0


# Two tokens sampled by mu with w = pi_prox / mu = [1.25, 0.8]: mu = lp - log w.
LP2 = [-1.0, -2.0]
MU2 = [-1.0 - math.log(1.25), -2.0 - math.log(0.8)]
ADV2 = [2.0, 1.0]


def two_token_loss(**kw):
    lp = leaf(LP2)
    loss, stats = policy_loss(
        lp,
        torch.tensor(MU2, dtype=torch.float64),
        torch.tensor(ADV2, dtype=torch.float64),
        torch.ones(2, dtype=torch.bool),
        cfg(**{"importance_level": "token", **kw}),
    )
    loss.backward()
    return loss.item(), lp.grad.tolist(), summarize({k: v.item() for k, v in stats.items()})


def test_decoupled_weights_by_proximal_over_behavior():
    loss, grad, m = two_token_loss(importance="decoupled")
    # pi_prox = pi_theta: r = 1 exactly; loss = -(1.25 * 2 + 0.8 * 1) / 2 = -1.65
    assert loss == pytest.approx(-1.65)
    assert grad == pytest.approx([-1.25, -0.4])  # -w A r / 2
    assert m["is_weight_mean"] == pytest.approx((1.25 + 0.8) / 2)
    assert m["is_weight_max"] == pytest.approx(1.25) and m["is_weight_min"] == pytest.approx(0.8)
    assert m["clip_fraction"] == 0.0


def test_truncated_importance_caps_the_weight():
    loss, grad, _ = two_token_loss(importance="truncated", is_high=1.1)
    # w = [min(1.25, 1.1), 0.8] = [1.1, 0.8]; loss = -(1.1 * 2 + 0.8) / 2 = -1.5
    assert loss == pytest.approx(-1.5)
    assert grad == pytest.approx([-1.1, -0.4])


def test_masked_importance_drops_tokens_outside_the_band():
    loss, grad, m = two_token_loss(importance="masked", is_low=0.5, is_high=1.2)
    # w = 1.25 > 1.2 -> token 0 masked; token 1: -0.8 * 1; normaliser stays 2 tokens -> -0.4
    assert loss == pytest.approx(-0.4)
    assert grad == pytest.approx([0.0, -0.4])
    assert m["is_masked_fraction"] == 0.5


def test_decoupled_clips_against_proximal_not_behavior():
    lp = leaf([-0.5])
    prox = torch.tensor([-1.0], dtype=torch.float64)
    mu = torch.tensor([-1.0 - math.log(1.25)], dtype=torch.float64)
    loss, stats = policy_loss(
        lp,
        mu,
        torch.tensor([1.0], dtype=torch.float64),
        torch.ones(1, dtype=torch.bool),
        cfg(importance="decoupled", importance_level="token"),
        proximal_logprobs=prox,
    )
    # r = exp(-0.5 + 1) = 1.64872 -> clipped to 1.28; w = 1.25: loss = -1.25 * 1.28 = -1.6
    assert loss.item() == pytest.approx(-1.6)
    # ppo_kl: k3 of pi_theta vs pi_prox, r = exp(0.5) = 1.648721: r - 1 - log r = 0.148721, weighted by
    # w = pi_prox / mu = 1.25 (sum 0.185902, weight 1.25) and normalised: 0.148721
    assert stats["ppo_kl_sum"].item() == pytest.approx(0.185902, abs=1e-6)
    assert summarize({k: v.item() for k, v in stats.items()})["ppo_kl"] == pytest.approx(0.148721, abs=1e-6)


@pytest.mark.parametrize("aggregation, expected", [("token", -2.5), ("sequence", -3.0), ("constant", -1.25)])
def test_aggregations(aggregation, expected):
    # ratio 1 (lp == mu, importance none): per-token loss = -A = [-4, -1, -2, -3]
    # token: -10 / 4 = -2.5; sequence: mean(-4, (-1 - 2 - 3) / 3 = -2) = -3
    # constant C = 4 (Dr.GRPO): mean(-4 / 4, -6 / 4) = mean(-1, -1.5) = -1.25
    lp = leaf([-1.0] * 4)
    seq_ids = torch.tensor([0, 1, 1, 1])
    loss, _ = policy_loss(
        lp,
        lp.detach(),
        torch.tensor([4.0, 1.0, 2.0, 3.0], dtype=torch.float64),
        torch.ones(4, dtype=torch.bool),
        cfg(importance="none", aggregation=aggregation, norm_constant=4.0),
        seq_ids=seq_ids,
    )
    assert loss.item() == pytest.approx(expected)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
def test_split_with_global_normaliser_equals_whole(aggregation):
    torch.manual_seed(0)
    lp = torch.randn(10, dtype=torch.float64) - 2
    mu = lp + 0.1 * torch.randn(10, dtype=torch.float64)
    adv = torch.randn(10, dtype=torch.float64)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    c = cfg(aggregation=aggregation, norm_constant=3.0)
    whole, _ = policy_loss(lp, mu, adv, mask, c, seq_ids=seq)
    norm = 7.0 if aggregation == "token" else 3.0  # 7 loss tokens, 3 sequences
    first, _ = policy_loss(lp[:6], mu[:6], adv[:6], mask[:6], c, seq_ids=seq[:6], normalizer=norm)
    second, _ = policy_loss(lp[6:], mu[6:], adv[6:], mask[6:], c, seq_ids=seq[6:] - 2, normalizer=norm)
    assert (first + second).item() == pytest.approx(whole.item(), abs=1e-12)


def test_k3_kl_to_reference():
    lp = leaf([-1.0])
    ref = torch.tensor([-1.0 + math.log(2.0)], dtype=torch.float64)
    loss, stats = policy_loss(
        lp,
        lp.detach(),
        torch.zeros(1, dtype=torch.float64),
        torch.ones(1, dtype=torch.bool),
        cfg(kl_coef=0.1, kl_correction=False),
        ref_logprobs=ref,
    )
    # ref / pi = 2: k3 = (2 - 1) - ln 2 = 0.306853; loss = 0.1 * 0.306853 (uncorrected: test_loss_modes has both)
    assert loss.item() == pytest.approx(0.0306853, abs=1e-7)
    loss.backward()
    # d k3 / d lp = 1 - ref / pi = -1 -> 0.1 * -1
    assert lp.grad.item() == pytest.approx(-0.1)
    assert stats["ref_kl_sum"].item() == pytest.approx(0.306853, abs=1e-6)


def test_kl_without_reference_is_a_named_error():
    lp = leaf([-1.0])
    with pytest.raises(ValueError, match="kl_coef"):
        policy_loss(lp, lp.detach(), lp.detach(), torch.ones(1, dtype=torch.bool), cfg(kl_coef=0.1))


def test_step_zero_behavior_equals_current_gives_ratio_one():
    torch.manual_seed(1)
    lp = (torch.randn(64) - 3).requires_grad_()
    adv = torch.randn(64)
    mask = torch.rand(64) > 0.2
    for importance in ("decoupled", "truncated", "masked", "none"):
        loss, stats = policy_loss(lp, lp.detach().clone(), adv, mask, cfg(importance=importance))
        m = summarize({k: v.item() for k, v in stats.items()})
        assert m["is_weight_max"] == 1.0 and m["is_weight_min"] == 1.0
        assert abs(m["ppo_kl"]) < 1e-6 and m["mismatch_kl"] < 1e-6
        assert m["clip_fraction"] == 0.0
        # ratio exactly 1: the loss is -mean(A) over the mask
        assert loss.item() == pytest.approx(-(adv[mask].sum() / mask.sum()).item(), abs=1e-6)


def test_mismatch_kl_only_on_tokens_of_the_current_version():
    lp = leaf([-1.0, -1.0])
    mu = torch.tensor([-0.9, -3.0], dtype=torch.float64)
    _, stats = policy_loss(
        lp,
        mu,
        torch.zeros(2, dtype=torch.float64),
        torch.ones(2, dtype=torch.bool),
        cfg(),
        same_version=torch.tensor([True, False]),
        entropy=torch.tensor([2.0, 4.0]),
    )
    m = summarize({k: v.item() for k, v in stats.items()})
    # k3 with pi / mu = exp(-0.1): 0.904837 - 1 + 0.1 = 0.004837 (token 1 is an older version)
    assert m["mismatch_kl"] == pytest.approx(0.004837, abs=1e-6)
    assert m["entropy"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    "override, field",
    [("loss.dual_clip=0.5", "loss.dual_clip"), ("loss.is_low=3.0", "loss.is_low"), ("loss.is_high=0", "loss.is_high")],
)
def test_bad_loss_config_names_the_field(override, field):
    from streamrl.engine.config import ConfigError, build

    with pytest.raises(ConfigError, match=field):
        build({}, [override])


def test_mismatch_is_unmeasured_without_same_version_tokens_and_behavior_kl_covers_all():
    import math

    from streamrl.learner.losses import summarize

    # one token sampled from mu: pi_prox = 0.5, mu = 0.25; k3 estimate of KL(mu || pi) with r = pi / mu = 2:
    # r - 1 - log r = 2 - 1 - 0.6931 = 0.3069
    logp = torch.tensor([math.log(0.5)])
    mu = torch.tensor([math.log(0.25)])
    cfg = LossConfig()
    for same, expect_mismatch in ((torch.tensor([False]), None), (torch.tensor([True]), 0.3069)):
        _, stats = policy_loss(logp, mu, torch.tensor([1.0]), torch.tensor([True]), cfg, same_version=same)
        out = summarize({k: float(v) for k, v in stats.items()})
        assert out["behavior_kl"] == pytest.approx(0.3069, abs=1e-4)
        if expect_mismatch is None:  # absent, not NaN: no sample of the learner's current version
            assert "mismatch_kl" not in out and out["mismatch_samples"] == 0
        else:
            assert out["mismatch_kl"] == pytest.approx(expect_mismatch, abs=1e-4) and out["mismatch_samples"] == 1
