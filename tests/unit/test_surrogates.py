"""`loss.surrogate` through the real `policy_loss`: CISPO, SAPO and GMPO against numbers worked by hand and
against the peers' formulas (verl b178a3c core_algos.py compute_policy_loss_cispo / _sapo / _geo_mean, TRL
f2cd577 GRPOTrainer._compute_loss loss_type cispo / sapo), written out here on padded [B, L] tensors."""

import math

import pytest
import torch

from streamrl.engine.config import ConfigError, LossConfig, build
from streamrl.learner.losses import policy_loss, summarize

F64 = torch.float64
ONES3 = torch.ones(3, dtype=torch.bool)
# three tokens, mu = pi_prox (w = 1): log r = [0.5, -0.5, 0], r = [1.648721, 0.606531, 1]; A = [1, -1, 2]
LP, OLD, ADV = [-1.0, -1.0, -1.0], [-1.5, -0.5, -1.0], [1.0, -1.0, 2.0]


def run(cfg, lp=LP, old=OLD, adv=ADV, mask=ONES3, seq_ids=None):
    logprobs = torch.tensor(lp, dtype=F64, requires_grad=True)
    old = torch.tensor(old, dtype=F64)
    loss, stats = policy_loss(
        logprobs, old, torch.tensor(adv, dtype=F64), mask, cfg, seq_ids=seq_ids, proximal_logprobs=old
    )
    loss.backward()
    return loss.item(), logprobs.grad, summarize({k: v.item() for k, v in stats.items()})


def test_cispo_by_hand():
    loss, grad, m = run(LossConfig(surrogate="cispo"))
    # clip(r, 0.8, 1.28) = [1.28, 0.8, 1.0], stopped; l = -c A lp = [1.28, -0.8, 2.0]; mean 0.826667
    assert loss == pytest.approx(0.826667, abs=1e-6)
    # every token keeps a gradient, clipped ones included: -c A / 3 = [-0.426667, 0.266667, -0.666667]
    assert grad.tolist() == pytest.approx([-0.426667, 0.266667, -0.666667], abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(2 / 3)
    # PPO-clip on the same tokens: both clipped tokens lose their gradient
    _, ppo_grad, _ = run(LossConfig())
    assert ppo_grad.tolist()[:2] == [0.0, 0.0]


def test_sapo_by_hand():
    loss, grad, m = run(LossConfig(surrogate="sapo"))
    # tau = [1, 1.05, 1] (A > 0: 1.0, else 1.05); gate = sigmoid(tau (r - 1)) 4 / tau
    #   = [4 sigmoid(0.648721) = 2.626889, (4 / 1.05) sigmoid(-0.413143) = 1.516795, 4 sigmoid(0) = 2]
    # l = -gate A = [-2.626889, 1.516795, -4]; mean -1.703365
    assert loss == pytest.approx(-1.703365, abs=1e-6)
    # d l / d lp = -4 r s (1 - s) A / 3 (tau cancels): [-0.495580, 0.193789, -0.666667]; at r = 1 it is -A / 3,
    # the plain policy gradient, and it fades smoothly with |r - 1| instead of stopping at a clip
    assert grad.tolist() == pytest.approx([-0.495580, 0.193789, -2 / 3], abs=1e-6)
    assert m["clip_fraction"] == 0.0


def test_gmpo_by_hand():
    # two sequences of two tokens; log r: seq 0 [0.5, 0.1] with A = 1, seq 1 [-0.6, 0.2] with A = -1
    lp, old = [-1.0, -1.0, -1.0, -1.0], [-1.5, -1.1, -0.4, -1.2]
    seq, mask = torch.tensor([0, 0, 1, 1]), torch.ones(4, dtype=torch.bool)
    loss, grad, m = run(gmpo_cfg(), lp, old, [1.0, 1.0, -1.0, -1.0], mask, seq)
    # seq 0 (A > 0): min(log r, clip(log r, -0.4, 0.4)) = [0.4, 0.1], mean 0.25, ratio e^0.25 = 1.284025, l = -1.284025
    # seq 1 (A < 0): max(log r, clip) = [-0.4, 0.2], mean -0.1, ratio e^-0.1 = 0.904837, l = +0.904837
    # mean over sequences: (-1.284025 + 0.904837) / 2 = -0.189594
    assert loss == pytest.approx(-0.189594, abs=1e-6)
    # unclipped tokens: d/dlp = -A ratio / 2 (token mean) / 2 (sequences): [0, -0.321006, 0, 0.226209]
    assert grad.tolist() == pytest.approx([0.0, -0.321006, 0.0, 0.226209], abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(0.5)


def gmpo_cfg(clip_low=0.4, clip_high=0.4):
    return LossConfig(surrogate="gmpo", clip_low=clip_low, clip_high=clip_high, aggregation="sequence")


# ---- against the peers' formulas, on random data (B sequences of L tokens, padded) ----

B, L = 4, 6


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, L, generator=g, dtype=F64) * 2 - 0.1
    old = lp + torch.randn(B, L, generator=g, dtype=F64) * 0.6  # ratios well past any clip
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, L).clone()
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    return lp, old, adv, mask


def ours(cfg, lp, old, adv, mask):
    """Our loss and gradient on the packed loss tokens of the padded batch."""
    leaf = lp.clone().requires_grad_()
    seq = torch.arange(B).unsqueeze(1).expand(B, L)[mask]
    loss, _ = policy_loss(leaf[mask], old[mask], adv[mask], torch.ones(int(mask.sum()), dtype=torch.bool), cfg,
                          seq_ids=seq, proximal_logprobs=old[mask])  # fmt: skip
    loss.backward()
    return loss.item(), leaf.grad


def peer(formula, lp, old, adv, mask):
    leaf = lp.clone().requires_grad_()
    loss = formula(leaf, old, adv, mask.to(F64))
    loss.backward()
    return loss.item(), leaf.grad * mask


def token_mean(x, m):
    return (x * m).sum() / m.sum()


def seq_mean_token_mean(x, m):
    return ((x * m).sum(-1) / m.sum(-1)).mean()


def verl_cispo(lo, hi):
    # -sg(clamp(r, 1 - lo, 1 + hi)) A log_prob, token-mean (verl's default loss_agg_mode)
    return lambda lp, old, a, m: token_mean(-torch.exp(lp - old).clamp(1 - lo, 1 + hi).detach() * a * lp, m)


def trl_cispo(eps_high):
    # -clamp(coef_1, max=epsilon_high).detach() A per_token_logps, over the batch's tokens (num_items_in_batch)
    return lambda lp, old, a, m: token_mean(-torch.exp(lp - old).clamp(max=eps_high).detach() * a * lp, m)


def sapo_formula(tau_pos, tau_neg):
    # verl and TRL alike: gate = sigmoid(tau (r - 1)) 4 / tau, tau by A > 0; seq-mean-token-mean
    def f(lp, old, a, m):
        tau = torch.where(a > 0, tau_pos, tau_neg)
        return seq_mean_token_mean(-torch.sigmoid(tau * (torch.exp(lp - old) - 1)) * 4 / tau * a, m)

    return f


def verl_geo_mean(lo, hi):
    # per sequence: sgn(A) min(sgn(A) lr, sgn(A) clamp(lr, -lo, hi)), masked mean, exp; -mean(A) x that; mean over B
    def f(lp, old, a, m):
        lr = lp - old
        s = torch.sign(a)
        kept = s * torch.minimum(s * lr, s * lr.clamp(-lo, hi))
        ratio = torch.exp((kept * m).sum(-1) / m.sum(-1))
        return (-(a * m).sum(-1) / m.sum(-1) * ratio).mean()

    return f


@pytest.mark.parametrize(
    "cfg, formula",
    [
        (LossConfig(surrogate="cispo", clip_low=0.2, clip_high=0.28), verl_cispo(0.2, 0.28)),
        # verl's example: clip_ratio_low = 10 (no lower bound), here clip_low = 1
        (LossConfig(surrogate="cispo", clip_low=1.0, clip_high=0.2), verl_cispo(10, 0.2)),
        (build({}, ["loss.preset='cispo'"]).loss, trl_cispo(5.0)),  # ScaleRL's: epsilon_high = 5, no lower bound
        (build({}, ["loss.preset='sapo'"]).loss, sapo_formula(1.0, 1.05)),
        (LossConfig(surrogate="sapo", aggregation="sequence", sapo_tau_pos=2.0, sapo_tau_neg=3.0), sapo_formula(2, 3)),
        (build({}, ["loss.preset='gmpo'"]).loss, verl_geo_mean(0.4, 0.4)),
        (gmpo_cfg(clip_low=0.1, clip_high=0.3), verl_geo_mean(0.1, 0.3)),
    ],
)  # fmt: skip
@pytest.mark.parametrize("seed", [0, 1])
def test_surrogate_equals_the_peer_formula(cfg, formula, seed):
    lp, old, adv, mask = batch(seed)
    value, grad = ours(cfg, lp, old, adv, mask)
    peer_value, peer_grad = peer(formula, lp, old, adv, mask)
    # sequence aggregation's weights 1 / |y| are fp32 (as the learner's logprobs are): 1e-7, not 1e-12, there
    tol = 1e-12 if cfg.aggregation == "token" else 1e-7
    assert value == pytest.approx(peer_value, abs=tol)
    assert torch.allclose(grad, peer_grad, atol=tol)


def test_presets_set_the_surrogates():
    cispo, sapo, gmpo = (build({}, [f"loss.preset='{p}'"]).loss for p in ("cispo", "sapo", "gmpo"))
    assert (cispo.surrogate, cispo.clip_low, cispo.clip_high, cispo.advantage) == ("cispo", 1.0, 4.0, "batch_std")
    assert (sapo.surrogate, sapo.sapo_tau_pos, sapo.sapo_tau_neg, sapo.aggregation) == ("sapo", 1.0, 1.05, "sequence")
    assert (gmpo.surrogate, gmpo.clip_low, gmpo.clip_high, gmpo.aggregation) == ("gmpo", 0.4, 0.4, "sequence")
    assert build({}, ["loss.preset='grpo'"]).loss.surrogate == "ppo_clip"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("loss.surrogate='vespo'", ["`loss.surrogate` = 'vespo'", "'ppo_clip', 'cispo', 'sapo', 'gmpo'"]),
        ("loss.sapo_tau_neg=0", ["`loss.sapo_tau_neg` = 0", "> 0.0"]),
    ],
)
def test_bad_surrogate_fields_are_named(override, expected):
    with pytest.raises(ConfigError) as err:
        build({}, [override])
    for part in expected:
        assert part in str(err.value)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"surrogate": "cispo", "dual_clip": 3.0}, "loss.dual_clip = 3.0 applies to surrogate = 'ppo_clip' only"),
        (
            {"surrogate": "gmpo", "ratio_level": "sequence"},
            "loss.ratio_level = 'sequence' with loss.surrogate = 'gmpo'",
        ),
    ],
)
def test_surrogate_conflicts_are_refused(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        LossConfig(**kw)


def test_log_ratio_clamp_keeps_every_surrogate_finite():
    for name in ("cispo", "sapo", "gmpo"):
        loss, grad, _ = run(LossConfig(surrogate=name), lp=[-1.0, -1.0, -1.0], old=[-200.0, -1.0, 50.0])
        assert math.isfinite(loss) and torch.isfinite(grad).all(), name
