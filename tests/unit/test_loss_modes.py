"""The loss menu against numbers worked by hand: a real proximal policy, GSPO, TIS/MIS at token and
sequence level, the log-ratio clamp, the k1/k2/k3 reference KL and the entropy bonus."""

import math

import pytest
import torch

from streamrl.engine.config import ConfigError, LossConfig, build
from streamrl.learner.losses import clipped_surrogate, policy_loss, summarize

F64 = torch.float64


def leaf(values, dtype=F64):
    return torch.tensor(values, dtype=dtype, requires_grad=True)


def const(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def means(stats):
    return summarize({k: v.item() for k, v in stats.items()})


def test_default_correction_is_bounded_token_truncation():
    c = LossConfig()
    assert (c.importance, c.importance_level, c.is_low, c.is_high) == ("truncated", "token", 0.0, 3.0)
    assert (c.ratio_level, c.log_ratio_clamp, c.kl_estimator, c.entropy_coef) == ("token", 20.0, "k3", 0.0)


def test_proximal_unlike_current_makes_the_clip_act():
    # mu = pi_prox, so w = 1 and only the PPO ratio r = pi_theta / pi_prox is at work
    lp = leaf([-1.0, -1.0, -1.0])
    prox = const([-1.5, -0.5, -0.9])
    adv = const([1.0, -1.0, 1.0])
    cfg = LossConfig(importance_level="token")
    loss, stats = policy_loss(lp, prox, adv, torch.ones(3, dtype=torch.bool), cfg, proximal_logprobs=prox)
    # r = [exp(.5) = 1.648721, exp(-.5) = 0.606531, exp(-.1) = 0.904837]
    # t0: A = 1, r > 1.28 -> -1.28 (clipped); t1: A = -1, r < 0.8 -> max(0.6065, 0.8) = 0.8 (clipped)
    # t2: A = 1, r inside [0.8, 1.28] -> -0.904837
    # loss = (-1.28 + 0.8 - 0.904837) / 3 = -0.461612
    assert loss.item() == pytest.approx(-0.461612, abs=1e-6)
    loss.backward()
    # clipped tokens get no gradient; t2: d(-r A / 3)/dlp = -0.904837 / 3
    assert lp.grad.tolist() == pytest.approx([0.0, 0.0, -0.301612], abs=1e-6)
    m = means(stats)
    assert m["clip_fraction"] == pytest.approx(2 / 3)
    # ppo_kl: mean k3 = r - 1 - log r (w = 1): (0.148721 + 0.106531 + 0.004837) / 3 = 0.086696
    assert m["ppo_kl"] == pytest.approx(0.086696, abs=1e-6)


def test_second_update_from_the_same_proximal_has_ratio_away_from_one():
    # One position, vocabulary of 3, logits z = 0, target token 0, A = 1: mini-batch PPO in miniature.
    z = torch.zeros(3, dtype=F64, requires_grad=True)
    target, mask, adv = 0, torch.ones(1, dtype=torch.bool), const([1.0])
    cfg = LossConfig(importance_level="token")
    prox = torch.log_softmax(z.detach(), -1)[target].reshape(1)  # log(1/3) = -1.098612, taken before update 1
    loss, stats = policy_loss(torch.log_softmax(z, -1)[target].reshape(1), prox, adv, mask, cfg, proximal_logprobs=prox)
    assert means(stats)["clip_fraction"] == 0.0 and means(stats)["ppo_kl"] == 0.0  # update 1: r = 1
    loss.backward()
    # d(-log p0)/dz = -(onehot - p) = [-2/3, 1/3, 1/3]; SGD, lr 1: z = [2/3, -1/3, -1/3]
    with torch.no_grad():
        z -= z.grad
    lp = torch.log_softmax(z, -1)[target].reshape(1)
    # log p0 = 2/3 - log(e^(2/3) + 2 e^(-1/3)) = 0.666667 - 1.218111 = -0.551445
    # r = exp(-0.551445 + 1.098612) = exp(0.547168) = 1.728351 > 1.28: clipped
    _, stats = policy_loss(lp, prox, adv, mask, cfg, proximal_logprobs=prox)
    m = means(stats)
    assert m["clip_fraction"] == 1.0
    # ppo_kl: k3 = r - 1 - log r = 1.728351 - 1 - 0.547168 = 0.181183 (>= 0, where k1 read -0.547168)
    assert m["ppo_kl"] == pytest.approx(0.181183, abs=1e-6)


# Two sequences of two tokens, mu = pi_prox (w = 1), A = 1 everywhere.
# log r = lp - prox: sequence 0 [0.2, 0.4], sequence 1 [0.1, -0.3].
GSPO_SEQ = torch.tensor([0, 0, 1, 1])
GSPO_PROX = [-1.2, -1.4, -1.1, -0.7]


def gspo(ratio_level):
    lp = leaf([-1.0] * 4)
    prox = const(GSPO_PROX)
    cfg = LossConfig(ratio_level=ratio_level)
    loss, stats = policy_loss(
        lp, prox, const([1.0] * 4), torch.ones(4, dtype=torch.bool), cfg, seq_ids=GSPO_SEQ, proximal_logprobs=prox
    )
    loss.backward()
    return loss.item(), lp.grad.tolist(), means(stats)


def test_gspo_clips_the_geometric_mean_ratio_per_sequence():
    loss, grad, m = gspo("sequence")
    # s0 = exp(mean(0.2, 0.4)) = exp(0.3) = 1.349859 > 1.28: both tokens clipped at -1.28
    # s1 = exp(mean(0.1, -0.3)) = exp(-0.1) = 0.904837: both tokens -0.904837
    # token mean: (-1.28 * 2 - 0.904837 * 2) / 4 = -1.092419
    assert loss == pytest.approx(-1.092419, abs=1e-6)
    # gradient of each token is its own: d(-s1 A / 4)/dlp_t = -s1 / 4 = -0.226209; sequence 0 none
    assert grad == pytest.approx([0.0, 0.0, -0.226209, -0.226209], abs=1e-6)
    assert m["clip_fraction"] == 0.5
    # ppo_kl stays per token: mean k3 of log r = [0.2, 0.4, 0.1, -0.3]:
    # (0.021403 + 0.091825 + 0.005171 + 0.040818) / 4 = 0.039804
    assert m["ppo_kl"] == pytest.approx(0.039804, abs=1e-6)


def test_token_ratio_on_the_same_data_clips_differently():
    loss, grad, m = gspo("token")
    # r = [exp(.2) = 1.221403, exp(.4) = 1.491825 (clipped: -1.28), exp(.1) = 1.105171, exp(-.3) = 0.740818]
    # (A > 0 and r < 0.8 is not clipped: min(r A, 0.8 A) = r A)
    # loss = (-1.221403 - 1.28 - 1.105171 - 0.740818) / 4 = -1.086848
    assert loss == pytest.approx(-1.086848, abs=1e-6)
    assert grad == pytest.approx([-1.221403 / 4, 0.0, -1.105171 / 4, -0.740818 / 4], abs=1e-6)
    assert m["clip_fraction"] == 0.25


# Token-level weights w = pi_prox / mu = [1.25, 0.8, 0.2], A = [2, 1, 1], ratio 1 (no proximal given).
TOK_W = [1.25, 0.8, 0.2]


def token_is(**kw):
    lp = leaf([-1.0, -2.0, -3.0])
    mu = const([-1.0 - math.log(TOK_W[0]), -2.0 - math.log(TOK_W[1]), -3.0 - math.log(TOK_W[2])])
    cfg = LossConfig(importance_level="token", **kw)
    loss, stats = policy_loss(lp, mu, const([2.0, 1.0, 1.0]), torch.ones(3, dtype=torch.bool), cfg)
    loss.backward()
    return loss.item(), lp.grad.tolist(), means(stats)


def test_token_truncated_with_a_lower_bound():
    loss, grad, m = token_is(importance="truncated", is_low=0.5, is_high=1.1)
    # w clamped to [0.5, 1.1]: [1.1, 0.8, 0.5]; loss = -(1.1 * 2 + 0.8 * 1 + 0.5 * 1) / 3 = -3.5 / 3
    assert loss == pytest.approx(-1.166667, abs=1e-6)
    assert grad == pytest.approx([-2.2 / 3, -0.8 / 3, -0.5 / 3])  # -w A / 3
    assert (m["is_weight_min"], m["is_weight_max"]) == pytest.approx((0.5, 1.1))


def test_token_masked_drops_both_sides():
    loss, grad, m = token_is(importance="masked", is_low=0.5, is_high=1.2)
    # 1.25 > 1.2 and 0.2 < 0.5 masked; kept: -0.8 * 1; the normaliser stays 3 tokens
    assert loss == pytest.approx(-0.8 / 3)
    assert grad == pytest.approx([0.0, -0.8 / 3, 0.0])
    assert m["is_masked_fraction"] == pytest.approx(2 / 3)
    assert m["is_weight_mean"] == pytest.approx(0.8)


# Three sequences, ratio 1, A = 1. Token weights: sequence 0 [1.5, 1.5], sequence 1 [0.5, 0.8],
# sequence 2 [4]. Sequence weights (products): 2.25, 0.4, 4.
SEQ = torch.tensor([0, 0, 1, 1, 2])
SEQ_TOKEN_W = [1.5, 1.5, 0.5, 0.8, 4.0]


def seq_is(**kw):
    lp = leaf([-1.0] * 5)
    mu = const([-1.0 - math.log(w) for w in SEQ_TOKEN_W])
    cfg = LossConfig(**{"importance_level": "sequence", **kw})
    loss, stats = policy_loss(lp, mu, const([1.0] * 5), torch.ones(5, dtype=torch.bool), cfg, seq_ids=SEQ)
    loss.backward()
    return loss.item(), lp.grad.tolist(), means(stats)


@pytest.mark.parametrize(
    "kw, expected_loss, expected_w, masked",
    [
        # w = [2.25, 2.25, 0.4, 0.4, min(4, 3) = 3]: -(4.5 + 0.8 + 3) / 5 = -1.66
        ({"importance": "truncated"}, -1.66, [2.25, 2.25, 0.4, 0.4, 3.0], 0),
        # lower bound 0.5 lifts sequence 1: -(4.5 + 1.0 + 3) / 5 = -1.7
        ({"importance": "truncated", "is_low": 0.5}, -1.7, [2.25, 2.25, 0.5, 0.5, 3.0], 0),
        # masked [0, 3] (TRL's default): sequence 2 (w = 4 > 3) masked: -(4.5 + 0.8) / 5 = -1.06
        ({"importance": "masked"}, -1.06, [2.25, 2.25, 0.4, 0.4, 0.0], 1),
        # [0.5, 3]: sequences 1 (0.4) and 2 (4) masked: -4.5 / 5 = -0.9
        ({"importance": "masked", "is_low": 0.5}, -0.9, [2.25, 2.25, 0.0, 0.0, 0.0], 3),
        # the same band per token keeps 0.5 (>= low) and drops only 4: -(1.5 + 1.5 + 0.5 + 0.8) / 5 = -0.86
        ({"importance": "masked", "is_low": 0.5, "importance_level": "token"}, -0.86, [1.5, 1.5, 0.5, 0.8, 0.0], 1),
        # the default, token truncation at 3: w = [1.5, 1.5, 0.5, 0.8, 3]: -(3 + 0.5 + 0.8 + 3) / 5 = -1.46
        ({"importance": "truncated", "importance_level": "token"}, -1.46, [1.5, 1.5, 0.5, 0.8, 3.0], 0),
    ],
)
def test_sequence_level_importance(kw, expected_loss, expected_w, masked):
    loss, grad, m = seq_is(**kw)
    assert loss == pytest.approx(expected_loss)
    assert grad == pytest.approx([-w / 5 for w in expected_w])  # d(-w r A / 5)/dlp, r = 1
    assert m["is_masked_fraction"] == pytest.approx(masked / 5)


def test_log_ratio_clamp_keeps_an_extreme_token_finite():
    # fp32, as the learner computes: a log-ratio of 100 is exp(100) = inf unclamped.
    mask = torch.ones(1, dtype=torch.bool)
    cfg = LossConfig(importance="decoupled")
    prox = torch.tensor([-101.0])
    # the PPO ratio: lp - prox = 100, w = 1 (mu = prox); A = +1 takes the clipped branch, A = -1 the unclipped
    raw = torch.tensor([-1.0], requires_grad=True)
    unclamped, _ = clipped_surrogate(torch.exp(raw - prox), torch.tensor([1.0]), cfg)
    unclamped.sum().backward()
    assert math.isnan(raw.grad.item())  # 0 x inf through the unclipped branch: what the old loss did
    for adv in (1.0, -1.0):
        lp = torch.tensor([-1.0], requires_grad=True)
        loss, _ = policy_loss(lp, prox, torch.tensor([adv]), mask, cfg, proximal_logprobs=prox)
        loss.backward()
        # A = 1: -1.28 (clipped); A = -1: -exp(20) A = 4.85165e8 (finite); no gradient past the clamp
        assert loss.item() == pytest.approx(-1.28 if adv > 0 else 4.85165e8, rel=1e-5)
        assert lp.grad.item() == 0.0
    # the importance weight: prox - mu = 100; decoupled w = exp(min(100, 20)), the default masks the sequence
    lp = torch.tensor([-1.0], requires_grad=True)
    mu = torch.tensor([-101.0])
    loss, stats = policy_loss(lp, mu, torch.tensor([1.0]), mask, cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-4.85165e8, rel=1e-5) and math.isfinite(lp.grad.item())


def test_bounded_modes_tame_an_extreme_importance_log_ratio():
    # prox - mu = 100 in fp32: the default caps w = e^100 at 3; sequence masking drops the sequence
    lp, mu, mask = torch.tensor([-1.0], requires_grad=True), torch.tensor([-101.0]), torch.ones(1, dtype=torch.bool)
    loss, stats = policy_loss(lp, mu, torch.tensor([1.0]), mask, LossConfig())
    loss.backward()
    # ratio 1, A = 1: -3 x 1, gradient -w r A = -3
    assert loss.item() == pytest.approx(-3.0) and lp.grad.item() == pytest.approx(-3.0)
    assert all(math.isfinite(v.item()) for v in stats.values())
    loss, stats = policy_loss(
        lp, mu, torch.tensor([1.0]), mask, LossConfig(importance="masked", importance_level="sequence")
    )
    assert loss.item() == 0.0 and means(stats)["is_masked_fraction"] == 1.0
    assert all(math.isfinite(v.item()) for k, v in stats.items() if k not in ("is_weight_min", "is_weight_max"))


@pytest.mark.parametrize(
    "estimator, value, grad, corrected_grad",
    [
        # r = ref / pi = 2, log r = 0.693147. mu = pi_theta: the correction's weight is 1 in value, and its
        # gradient d(pi_theta / mu)/dlp = 1 adds the estimate itself: corrected = grad + value
        ("k1", -0.693147, 1.0, 0.306853),  # -log r = lp - ref; d/dlp = 1
        ("k2", 0.240227, -0.693147, -0.452920),  # (log r)^2 / 2 = 0.480453 / 2; d/dlp = log r x (-1)
        ("k3", 0.306853, -1.0, -0.693147),  # (2 - 1) - 0.693147; d/dlp = (r - 1)(-1)
    ],
)
@pytest.mark.parametrize("correction", [False, True])
def test_kl_estimators(estimator, value, grad, corrected_grad, correction):
    lp = leaf([-1.0])
    ref = const([-1.0 + math.log(2.0)])
    cfg = LossConfig(kl_coef=0.1, kl_estimator=estimator, kl_correction=correction)
    # A = 0: the policy term is 0, the loss is 0.1 x the estimate
    loss, stats = policy_loss(lp, lp.detach(), const([0.0]), torch.ones(1, dtype=torch.bool), cfg, ref_logprobs=ref)
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * value, abs=1e-7)
    assert lp.grad.item() == pytest.approx(0.1 * (corrected_grad if correction else grad), abs=1e-6)
    assert means(stats)["ref_kl"] == pytest.approx(value, abs=1e-6)


def test_entropy_bonus_pushes_towards_higher_entropy():
    # logits z = [0, 1], one position, target token 1, A = 0: only the bonus acts.
    z = leaf([0.0, 1.0])
    logp = torch.log_softmax(z, -1)
    entropy = -(logp.exp() * logp).sum().reshape(1)
    cfg = LossConfig(entropy_coef=0.1)
    mask = torch.ones(1, dtype=torch.bool)
    loss, stats = policy_loss(logp[1].reshape(1), logp[1].detach().reshape(1), const([0.0]), mask, cfg, entropy=entropy)
    # p = [0.268941, 0.731059]; H = log(1 + e) - E_p[z] = 1.313262 - 0.731059 = 0.582203; loss = -0.1 H
    assert loss.item() == pytest.approx(-0.0582203, abs=1e-7)
    loss.backward()
    # dH/dz_j = -p_j (z_j - E_p[z]) = [0.196612, -0.196612]; d loss/dz = -0.1 x that:
    # descent raises the smaller logit and lowers the larger, towards uniform (higher entropy)
    assert z.grad.tolist() == pytest.approx([-0.0196612, 0.0196612], abs=1e-7)
    assert means(stats)["entropy"] == pytest.approx(0.582203, abs=1e-6)


def test_entropy_bonus_without_a_differentiable_entropy_is_a_named_error():
    lp = leaf([-1.0])
    cfg = LossConfig(entropy_coef=0.1)
    mask = torch.ones(1, dtype=torch.bool)
    for entropy in (None, const([1.0])):
        with pytest.raises(ValueError, match="entropy_coef"):
            policy_loss(lp, lp.detach(), const([1.0]), mask, cfg, entropy=entropy)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"importance": "masked", "importance_level": "sequence"},
        {"importance": "truncated", "importance_level": "sequence", "is_low": 0.5, "is_high": 1.5},
        {"ratio_level": "sequence", "aggregation": "sequence"},
        {"kl_coef": 0.1, "kl_estimator": "k2", "entropy_coef": 0.01, "aggregation": "constant"},
    ],
)
def test_sequence_modes_split_with_global_normaliser_equal_whole(kw):
    # sequence-level weights and ratios are per call, so a split between sequences changes nothing
    torch.manual_seed(0)
    lp = (torch.randn(10, dtype=F64) - 2).requires_grad_()
    prox = lp.detach() + 0.05 * torch.randn(10, dtype=F64)
    mu = prox + 0.2 * torch.randn(10, dtype=F64)
    ref, ent = prox + 0.1, torch.rand(10, dtype=F64).requires_grad_()
    adv = torch.randn(10, dtype=F64)
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 2])
    cfg = LossConfig(norm_constant=3.0, **kw)

    def part(sl, shift, norm=None):
        return policy_loss(
            lp[sl],
            mu[sl],
            adv[sl],
            mask[sl],
            cfg,
            seq_ids=seq[sl] - shift,
            proximal_logprobs=prox[sl],
            ref_logprobs=ref[sl],
            entropy=ent[sl],
            normalizer=norm,
        )[0]

    whole = part(slice(None), 0)
    norm = 7.0 if cfg.aggregation == "token" else 3.0  # 7 loss tokens, 3 sequences
    split = part(slice(0, 6), 0, norm) + part(slice(6, None), 2, norm)
    assert split.item() == pytest.approx(whole.item(), abs=1e-12)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("loss.is_low=3.0", ["loss.is_low = 3.0", "loss.is_high = 3.0"]),
        ("loss.is_high=0", ["`loss.is_high` = 0", "> 0.0"]),
        ("loss.log_ratio_clamp=100", ["`loss.log_ratio_clamp` = 100", "<= 80.0"]),
        ("loss.entropy_coef=-1", ["`loss.entropy_coef` = -1", ">= 0.0"]),
        ("loss.importance_level='batch'", ["`loss.importance_level` = 'batch'", "'token', 'sequence'"]),
        ("loss.ratio_level='word'", ["`loss.ratio_level` = 'word'", "'token', 'sequence'"]),
    ],
)
def test_new_loss_fields_name_field_value_and_range(override, expected):
    with pytest.raises(ConfigError) as err:
        build({}, [override])
    for part in expected:
        assert part in str(err.value)
