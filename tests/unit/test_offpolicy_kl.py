"""The reference-KL term on stale samples, exactly: one position, a vocabulary of 8, every token enumerated.

E_mu[term] = sum_y mu(y) term(y), each term(y) from the real `policy_loss` (A = 0, so only the KL term acts),
and its gradient by autograd. On pi_theta's own samples (mu = pi_theta) that is the on-policy term; at three
staleness levels (behavior policies further from pi_theta) the corrected term (`kl_correction`, weighted by
pi_theta / mu) must give the same value and gradient, and the uncorrected one must not.
"""

import pytest
import torch

from streamrl.engine.config import LossConfig
from streamrl.learner.losses import policy_loss

F64 = torch.float64
V = 8
torch.manual_seed(0)
LOGITS = torch.randn(V, dtype=F64)  # pi_theta's
NOISE = torch.randn(V, dtype=F64)
REF = torch.log_softmax(LOGITS + 0.5 * torch.randn(V, dtype=F64), -1)  # KL(pi_theta || ref) = 0.0915
# behavior logits = LOGITS + s x NOISE: KL(mu || pi_theta) = 0.094, 0.41, 1.31
STALENESS = (0.8, 1.6, 2.8)


def expectation(cfg: LossConfig, behavior_logits: torch.Tensor | None) -> tuple[float, torch.Tensor]:
    """(E_mu[KL term], its gradient in pi_theta's logits); mu = pi_theta itself when behavior_logits is None."""
    z = LOGITS.clone().requires_grad_()
    logp = torch.log_softmax(z, -1)
    mu = logp.detach() if behavior_logits is None else torch.log_softmax(behavior_logits, -1)
    one = torch.ones(1, dtype=torch.bool)
    total = sum(
        mu[y].exp()
        * policy_loss(
            logp[y : y + 1],
            mu[y : y + 1],
            torch.zeros(1, dtype=F64),
            one,
            cfg,
            ref_logprobs=REF[y : y + 1],
            normalizer=1,
        )[0]
        for y in range(V)
    )
    (grad,) = torch.autograd.grad(total, z)
    return total.item() / cfg.kl_coef, grad / cfg.kl_coef


def kl_gradient(forward: bool) -> torch.Tensor:
    """Gradient in pi_theta's logits of KL(pi_theta || ref) (forward) or KL(ref || pi_theta), in closed form."""
    z = LOGITS.clone().requires_grad_()
    logp = torch.log_softmax(z, -1)
    kl = (logp.exp() * (logp - REF)).sum() if forward else (REF.exp() * (REF - logp)).sum()
    (grad,) = torch.autograd.grad(kl, z)
    return grad


def config(estimator: str, corrected: bool) -> LossConfig:
    # the weight's cap raised so that it never binds here: the exactness is the unbounded weight's
    return LossConfig(kl_coef=0.5, kl_estimator=estimator, kl_correction=corrected, is_high=1e3)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("scale", STALENESS)
def test_corrected_term_is_the_on_policy_one_at_any_staleness(estimator, scale):
    on_value, on_grad = expectation(config(estimator, True), None)
    value, grad = expectation(config(estimator, True), LOGITS + scale * NOISE)
    assert value == pytest.approx(on_value, abs=1e-12)
    assert torch.allclose(grad, on_grad, atol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("scale", STALENESS)
def test_uncorrected_term_drifts_with_staleness(estimator, scale):
    on_value, on_grad = expectation(config(estimator, False), None)
    value, grad = expectation(config(estimator, False), LOGITS + scale * NOISE)
    mu = torch.log_softmax(LOGITS + scale * NOISE, -1)
    behavior_kl = (mu.exp() * (mu - torch.log_softmax(LOGITS, -1))).sum().item()
    gap = (grad - on_grad).norm().item()
    # the smallest staleness (KL(mu || pi) = 0.094) already moves the gradient by more than 0.02
    assert gap > 0.02, (estimator, behavior_kl, gap, value - on_value)


def test_on_policy_gradients_are_the_documented_ones():
    # uncorrected, as a loss on pi_theta's samples: k3 gives KL(ref || pi)'s gradient, k2 KL(pi || ref)'s, k1 none
    assert torch.allclose(expectation(config("k3", False), None)[1], kl_gradient(forward=False), atol=1e-12)
    assert torch.allclose(expectation(config("k2", False), None)[1], kl_gradient(forward=True), atol=1e-12)
    assert torch.allclose(expectation(config("k1", False), None)[1], torch.zeros(V, dtype=F64), atol=1e-12)
    # corrected (the default), k1 and k3 are unbiased estimates of KL(pi || ref): the gradient is that KL's
    forward = kl_gradient(forward=True)
    assert torch.allclose(expectation(config("k3", True), None)[1], forward, atol=1e-12)
    assert torch.allclose(expectation(config("k1", True), None)[1], forward, atol=1e-12)
    # and the value is the KL itself: sum pi log(pi / ref)
    logp = torch.log_softmax(LOGITS, -1)
    exact = (logp.exp() * (logp - REF)).sum().item()
    assert expectation(config("k3", True), None)[0] == pytest.approx(exact, abs=1e-12)
    assert exact == pytest.approx(0.0915, abs=1e-4)  # the case is the one the module doc describes


def test_default_weight_is_bounded_like_the_policy_weight():
    # one token with pi_theta / mu = e^3 = 20.1: the default truncation caps the KL weight at 3, as the policy's
    lp = torch.tensor([-1.0], dtype=F64, requires_grad=True)
    mu, ref = torch.tensor([-4.0], dtype=F64), torch.tensor([-1.0 + 0.6931471805599453], dtype=F64)
    cfg = LossConfig(kl_coef=1.0)
    assert cfg.kl_correction and cfg.is_high == 3.0
    loss, _ = policy_loss(lp, mu, torch.zeros(1, dtype=F64), torch.ones(1, dtype=torch.bool), cfg, ref_logprobs=ref)
    # k3 at ref / pi = 2: 1 - ln 2 = 0.306853; weight min(e^3, 3) = 3 -> 0.920558
    assert loss.item() == pytest.approx(3 * 0.306853, abs=1e-6)
