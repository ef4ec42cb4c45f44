"""`loss.rejection` against numbers worked by hand, and each peer's rule written out on padded [B, L] tensors:
verl b178a3c rollout_corr_helper.compute_rollout_rejection_mask (`rollout_rs`, `rollout_rs_threshold`),
AReaL's functional.apply_rejection_sampling (`actor.rejection_sampling`), TRL f2cd577
GRPOTrainer.get_off_policy_mask (`off_policy_mask_threshold`)."""

import math

import pytest
import torch

from streamrl.engine.config import ConfigError, LossConfig, build
from streamrl.engine.config.rejection import RejectionConfig
from streamrl.learner import rejection
from streamrl.learner.losses import policy_loss, summarize

F64 = torch.float64


def out(prox, mu, adv, cfg, seq_ids=None, mask=None):
    prox, mu, adv = (torch.tensor(x, dtype=F64) for x in (prox, mu, adv))
    mask = torch.ones_like(prox, dtype=torch.bool) if mask is None else mask
    return rejection.rejected(prox, mu, adv, mask, seq_ids, cfg).tolist()


def test_token_k1_band_by_hand():
    # log r = prox - mu = [0.2, -0.3, 0.05]; k1 = -log r = [-0.2, 0.3, -0.05]; band [-0.1, 0.1]
    cfg = RejectionConfig(level="token", metric="k1", lower=-0.1, upper=0.1)
    assert out([-1.0, -1.3, -1.0], [-1.2, -1.0, -1.05], [1.0, 1.0, 1.0], cfg) == [True, True, False]


def test_sequence_mean_k1_with_the_advantage_gate_by_hand():
    # seq 0: log r = [-0.4, 0.0] -> mean k1 = 0.2 > 0.1, A < 0: rejected; seq 1: the same, A > 0: kept (gate);
    # seq 2: log r = [0.1, -0.1] -> mean k1 = 0 <= 0.1: kept
    cfg = RejectionConfig(level="sequence", metric="k1", upper=0.1, advantage="negative")
    seq = torch.tensor([0, 0, 1, 1, 2, 2])
    prox, mu = [-1.4, -1.0, -1.4, -1.0, -0.9, -1.1], [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]
    adv = [-1.0, -1.0, 1.0, 1.0, -1.0, -1.0]
    assert out(prox, mu, adv, cfg, seq) == [True, True, False, False, False, False]


@pytest.mark.parametrize(
    "metric, aggregation, value",
    [
        # log r = [0.5, -0.1, 0.2]: ratio sum = e^0.6 = 1.822119, mean = e^0.2 = 1.221403, max = e^0.5 = 1.648721
        ("ratio", "sum", 1.822119),
        ("ratio", "mean", 1.221403),
        ("ratio", "max", 1.648721),
        # k2 = [0.125, 0.005, 0.02]: sum 0.15, mean 0.05, max 0.125
        ("k2", "sum", 0.15),
        ("k2", "mean", 0.05),
        ("k2", "max", 0.125),
        # k3 = r - 1 - log r = [0.148721, 0.004837, 0.021403]: sum 0.174961, mean 0.058320, max 0.148721
        ("k3", "sum", 0.174961),
        ("k3", "mean", 0.058320),
        ("k3", "max", 0.148721),
    ],
)
def test_sequence_statistics_by_hand(metric, aggregation, value):
    log_r = torch.tensor([0.5, -0.1, 0.2], dtype=F64)
    cfg = RejectionConfig(level="sequence", metric=metric, aggregation=aggregation, upper=10.0)
    got = rejection.statistic(log_r, torch.ones(3, dtype=torch.bool), None, cfg)
    got = got.exp() if metric == "ratio" else got  # ratio's statistic is kept in log space
    assert got.tolist() == pytest.approx([value] * 3, abs=1e-6)
    # a band just under / over the value rejects / keeps the sequence
    for upper, rejected in ((value * 0.999, True), (value * 1.001, False)):
        band = RejectionConfig(level="sequence", metric=metric, aggregation=aggregation, upper=upper)
        assert out([0.5, -0.1, 0.2], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], band) == [rejected] * 3


# ---- the peers' rules on random padded batches ----

B, L = 6, 5
LENGTHS = torch.tensor([5, 3, 5, 5, 1, 5])  # loss tokens of each row: the rest is padding


def batch(seed, spread=0.3):
    """(pi_prox, mu, advantages, mask) of B padded rows: log-probs in (-2.1, -0.1), pi_prox = mu + spread x noise."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(2, B, L, generator=g, dtype=F64)
    mu = -2 * torch.sigmoid(noise[0]) - 0.1
    per_row = torch.randn(B, generator=g, dtype=F64)
    return mu + spread * noise[1], mu, per_row[:, None].expand(B, L), torch.arange(L) < LENGTHS[:, None]


def ours_keep(cfg, prox, mu, adv, mask):
    """Which loss tokens our rule keeps, laid out [B, L] (False off the mask)."""
    seq = torch.arange(B).unsqueeze(1).expand(B, L)[mask]
    rejected = rejection.rejected(prox[mask], mu[mask], adv[mask], torch.ones(int(mask.sum()), dtype=torch.bool),
                                  seq, cfg)  # fmt: skip
    keep = torch.zeros(B, L, dtype=torch.bool)
    keep[mask] = ~rejected
    return keep


def verl_keep(option, lower, upper, prox, mu, mask):
    """verl's rollout_rs: log r = old - rollout; k1 = -log r against log(lower)..log(upper); k2/k3 upper only."""
    lr = (prox - mu).clamp(-20, 20)
    m = mask.to(F64)
    per = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1 - lr}[option[-2:]]
    if option.startswith("token"):
        stat = per
    elif option.startswith("seq_sum"):
        stat = (per * m).sum(-1, keepdim=True).expand(B, L)
    elif option.startswith("seq_mean"):
        stat = ((per * m).sum(-1) / m.sum(-1)).unsqueeze(-1).expand(B, L)
    else:
        stat = per.masked_fill(~mask, -math.inf).max(-1, keepdim=True).values.expand(B, L)
    keep = (stat >= math.log(lower)) & (stat <= math.log(upper)) if option.endswith("k1") else stat <= upper
    return keep & mask


def verl_threshold(option, lower, upper):
    """The same rule in streamrl's terms: k1's band is the log of verl's ratio band."""
    level, agg = ("token", "mean") if option.startswith("token") else ("sequence", option.split("_")[1])
    if option.endswith("k1"):
        return RejectionConfig(level=level, metric="k1", aggregation=agg, lower=math.log(lower), upper=math.log(upper))
    return RejectionConfig(level=level, metric=option[-2:], aggregation=agg, upper=upper)


@pytest.mark.parametrize(
    "option, lower, upper",
    [
        ("seq_mean_k1", 0.999, 1.001),  # the one-step-off recipe's, 0.999_1.001
        ("seq_mean_k1", 0.9, 1.1),
        ("seq_mean_k3", None, 0.05),
        ("seq_max_k2", None, 0.1),
        ("seq_sum_k1", 0.5, 2.0),
        ("token_k3", None, 0.04),
        ("token_k1", 0.8, 1.25),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_verl_rollout_rs(option, lower, upper, seed):
    prox, mu, adv, mask = batch(seed, spread=0.3 if lower != 0.999 else 0.002)
    keep = ours_keep(verl_threshold(option, lower, upper), prox, mu, adv, mask)
    expected = verl_keep(option, lower, upper, prox, mu, mask)
    assert torch.equal(keep, expected)
    assert 0 < int((mask & ~keep).sum()) < int(mask.sum())  # the case rejects some, not all


def areal_keep(level, metric, agg, lower, upper, prox, mu, mask):
    """AReaL's rejection_sampling (mask action): metric of log r = prox - behave; ratio aggregated in log space."""
    lr = prox - mu
    m = mask.to(F64)
    if metric == "ratio":
        per = lr
    else:  # its KLEstimator: k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r
        per = {"kl_k1": lr, "kl_k2": lr**2 / 2, "kl_k3": torch.exp(-lr) - 1 + lr}[metric]
    if level == "sequence":
        if agg == "max":
            per = per.masked_fill(~mask, -math.inf).max(-1, keepdim=True).values
        else:
            per = (per * m).sum(-1, keepdim=True) / (m.sum(-1, keepdim=True) if agg == "mean" else 1)
        per = per.expand(B, L)
    stat = torch.exp(per) if metric == "ratio" else per
    keep = stat <= upper if lower is None else (stat >= lower) & (stat <= upper)
    return keep & mask


@pytest.mark.parametrize(
    "level, metric, agg, lower, upper, ours",
    [
        ("token", "ratio", "mean", 0.8, 1.25, {"metric": "ratio", "lower": 0.8, "upper": 1.25}),
        ("sequence", "ratio", "mean", 0.9, 1.1, {"metric": "ratio", "lower": 0.9, "upper": 1.1}),
        ("sequence", "ratio", "sum", 0.5, 2.0, {"metric": "ratio", "aggregation": "sum", "lower": 0.5, "upper": 2.0}),
        ("sequence", "ratio", "max", None, 1.3, {"metric": "ratio", "aggregation": "max", "upper": 1.3}),
        # AReaL's kl_k1 is +log r: its band [l, u] is k1's [-u, -l]
        ("sequence", "kl_k1", "mean", -0.1, 0.05, {"metric": "k1", "lower": -0.05, "upper": 0.1}),
        ("sequence", "kl_k2", "max", None, 0.08, {"metric": "k2", "aggregation": "max", "upper": 0.08}),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_areal_rejection_sampling(level, metric, agg, lower, upper, ours, seed):
    prox, mu, adv, mask = batch(seed)
    keep = ours_keep(RejectionConfig(level=level, **ours), prox, mu, adv, mask)
    expected = areal_keep(level, metric, agg, lower, upper, prox, mu, mask)
    assert torch.equal(keep, expected)
    assert 0 < int((mask & ~keep).sum()) < int(mask.sum())


@pytest.mark.parametrize("delta", [0.02, 0.1])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trl_off_policy_mask(delta, seed):
    prox, mu, adv, mask = batch(seed)
    # TRL: keep a sequence if A >= 0 or mean(log mu - log pi) <= delta (pi_theta detached: pi_prox on update 1)
    seq_kl = ((mu - prox) * mask).sum(-1) / mask.sum(-1)
    expected = ((adv[:, 0] >= 0) | (seq_kl <= delta)).unsqueeze(-1).expand(B, L) & mask
    cfg = RejectionConfig(level="sequence", metric="k1", aggregation="mean", upper=delta, advantage="negative")
    assert torch.equal(ours_keep(cfg, prox, mu, adv, mask), expected)


def test_policy_loss_masks_rejected_tokens_and_reports_the_share():
    lp = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=F64, requires_grad=True)
    mu = torch.tensor([-1.0, -1.6, -1.0, -1.0], dtype=F64)  # token 1: k1 = log(mu / pi) = -0.6, out of [-0.5, 0.5]
    cfg = LossConfig(importance="decoupled", rejection=RejectionConfig(level="token", lower=-0.5, upper=0.5))
    loss, stats = policy_loss(lp, mu, torch.ones(4, dtype=F64), torch.ones(4, dtype=torch.bool), cfg)
    loss.backward()
    # kept tokens: w = 1, l = -1; token 1 gets no policy loss but stays in the normaliser: loss = -3 / 4
    assert loss.item() == pytest.approx(-0.75)
    assert lp.grad.tolist() == pytest.approx([-0.25, 0.0, -0.25, -0.25])
    assert summarize({k: v.item() for k, v in stats.items()})["rejected_fraction"] == 0.25


def test_clamp_action_bounds_the_weight_instead():
    lp = torch.tensor([-1.0, -1.0], dtype=F64, requires_grad=True)
    mu = torch.tensor([-1.0, -2.0], dtype=F64)  # token 1: w = pi / mu = e = 2.718282, clamped to 2
    reject = RejectionConfig(level="token", metric="ratio", lower=0.5, upper=2.0, action="clamp")
    loss, stats = policy_loss(lp, mu, torch.ones(2, dtype=F64), torch.ones(2, dtype=torch.bool),
                              LossConfig(importance="decoupled", rejection=reject))  # fmt: skip
    # l = -w: (-1 - 2) / 2 = -1.5
    assert loss.item() == pytest.approx(-1.5)
    assert stats["rejected_sum"].item() == 1.0


def test_off_by_default_and_bad_bands_are_named():
    assert LossConfig().rejection.level == "none"
    with pytest.raises(ConfigError, match="neither loss.rejection.lower nor loss.rejection.upper"):
        build({}, ["loss.rejection.level='sequence'"])
    with pytest.raises(ConfigError, match="loss.rejection.lower = 0.2 must be below loss.rejection.upper = 0.1"):
        build({}, ["loss.rejection.level='token'", "loss.rejection.lower=0.2", "loss.rejection.upper=0.1"])
    with pytest.raises(ConfigError, match="action = 'clamp' with metric = 'k3'"):
        build({}, ["loss.rejection.level='token'", "loss.rejection.metric='k3'", "loss.rejection.upper=1.0",
                   "loss.rejection.action='clamp'"])  # fmt: skip
    with pytest.raises(ConfigError, match="`loss.rejection.metric` = 'kl_k1'"):
        build({}, ["loss.rejection.metric='kl_k1'"])
