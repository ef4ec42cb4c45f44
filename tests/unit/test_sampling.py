"""The sampling distribution (engine/sampling.py) on constructed logits: equal to what transformers' own
warpers sample from, and recomputed by the learner's chunked head (learner/logprobs.py) with the same values
and the gradient autograd gives through the filtered log-softmax. (vLLM's filter: tests/integration/
test_rollout_parity.py.)"""

import math

import pytest
import torch

from streamrl.engine.sampling import keep_floor, processed_logprobs
from streamrl.learner.logprobs import chunked_logprobs

SETTINGS = [dict(temperature=0.7, top_p=0.8), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_k=7, top_p=0.6)]
IDS = ["T0.7-p0.8", "k5", "T1.3-k7-p0.6"]


def hf_sampling_distribution(logits, temperature=1.0, top_k=0, top_p=1.0):
    """log_softmax of the scores transformers' generate samples from: its warpers, in its order."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits.float()
    for warper in (
        TemperatureLogitsWarper(temperature) if temperature != 1.0 else None,
        TopKLogitsWarper(top_k) if top_k else None,
        TopPLogitsWarper(top_p) if top_p < 1.0 else None,
    ):
        if warper is not None:
            scores = warper(None, scores)
    return scores.log_softmax(-1)


def test_a_worked_top_p_row():
    # logits log[0.5, 0.3, 0.15, 0.05], top_p 0.75: ascending cumulative 0.05, 0.20, 0.50, 1.0; the prefix
    # <= 0.25 (0.05 and 0.15) is dropped, {0.5, 0.3} kept and renormalised: log(0.625), log(0.375)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert keep_floor(logits, top_p=0.75).item() == pytest.approx(math.log(0.3), abs=1e-6)
    out = processed_logprobs(logits, top_p=0.75)[0]
    assert out[:2].tolist() == pytest.approx([math.log(0.625), math.log(0.375)], abs=1e-6)
    assert out[2:].tolist() == [-math.inf, -math.inf]


@pytest.mark.parametrize("sampling", SETTINGS, ids=IDS)
def test_processed_logprobs_are_the_distribution_transformers_samples_from(sampling):
    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    ours, theirs = processed_logprobs(logits, **sampling), hf_sampling_distribution(logits, **sampling)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))  # the same tokens kept, row by row
    kept = torch.isfinite(ours)
    assert (ours[kept] - theirs[kept]).abs().max() < 1e-5
    assert 0 < kept.sum(-1).float().mean() < 50  # the filters did cut


@pytest.mark.parametrize("keep_logits_bytes", [0, 2**20], ids=["recompute", "keep"])
@pytest.mark.parametrize("sampling", SETTINGS, ids=IDS)
def test_the_learner_recomputes_the_sampling_distribution_and_its_gradient(sampling, keep_logits_bytes):
    torch.manual_seed(1)
    hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(50, 8, dtype=torch.float64) * 1.5).requires_grad_()
    g, g_entropy = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    with torch.no_grad():  # targets the sampler could have drawn: the likeliest token of each row
        reference = processed_logprobs(hidden @ weight.t(), **sampling)
        targets = reference.argmax(-1)
    # autograd through the filtered log-softmax (the filter a constant mask, as it is almost everywhere)
    z = (hidden @ weight.t()) / sampling["temperature"]
    kept = torch.isfinite(reference)
    log_p = torch.log_softmax(z.masked_fill(~kept, -math.inf), -1)
    ref_lp = log_p.gather(1, targets[:, None]).squeeze(1)
    ref_entropy = -(log_p.exp() * log_p.masked_fill(~kept, 0.0)).sum(-1)
    ref_grads = torch.autograd.grad((ref_lp * g).sum() + (ref_entropy * g_entropy).sum(), (hidden, weight))

    lp, entropy = chunked_logprobs(hidden, weight, targets, chunk=3, keep_logits_bytes=keep_logits_bytes, **sampling)
    grads = torch.autograd.grad((lp * g).sum() + (entropy * g_entropy).sum(), (hidden, weight))
    assert (lp.double() - ref_lp).abs().max() < 1e-5
    assert (lp.double() - reference.gather(1, targets[:, None]).squeeze(1)).abs().max() < 1e-5
    assert (entropy.double() - ref_entropy).abs().max() < 1e-5
    for got, want in zip(grads, ref_grads):
        assert (got - want).abs().max() < 1e-5


def test_a_target_outside_the_kept_tokens_stays_finite():
    """The learner's weights moved since the token was sampled: it is no longer in the nucleus. Its value is
    its logit against the kept tokens' log-sum-exp (below every kept one), never -inf (which would poison every
    masked sum with 0 x inf)."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().double().requires_grad_()
    weight = torch.eye(4, dtype=torch.float64)
    lp, _ = chunked_logprobs(logits, weight, torch.tensor([3]), top_p=0.75)
    # log(0.05) - log(0.5 + 0.3) = log(0.0625)
    assert lp.item() == pytest.approx(math.log(0.0625), abs=1e-6)
    lp.sum().backward()
    # d/dz: onehot(3) - p_kept = [-0.625, -0.375, 0, 1]
    assert logits.grad[0].tolist() == pytest.approx([-0.625, -0.375, 0.0, 1.0], abs=1e-6)
