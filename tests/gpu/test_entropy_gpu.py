"""The entropy bonus's gradient on CUDA: the LM head's backward falls back from the Triton kernel (no entropy
term) to the compiled row math when the loss uses the entropy."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_entropy_gradient_on_cuda_matches_fp64_autograd():
    from streamrl.learner.logprobs import chunked_logprobs

    torch.manual_seed(0)
    hidden = (torch.randn(600, 128, device="cuda")).bfloat16().requires_grad_(True)
    weight = (torch.randn(5003, 128, device="cuda") * 0.1).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 5003, (600,), device="cuda")
    g, g_entropy = torch.randn(600, device="cuda"), torch.randn(600, device="cuda")
    h64, w64 = (x.detach().double().requires_grad_(True) for x in (hidden, weight))
    log_p = torch.log_softmax((h64 @ w64.t()) / 0.7, -1)
    entropy64 = -(log_p.exp() * log_p).sum(-1)
    want = torch.autograd.grad(
        (log_p.gather(1, targets[:, None]).squeeze(1) * g).sum() + (entropy64 * g_entropy).sum(), (h64, w64)
    )

    lp, entropy = chunked_logprobs(hidden, weight, targets, chunk=256, temperature=0.7)
    got = torch.autograd.grad((lp * g).sum() + (entropy * g_entropy).sum(), (hidden, weight))
    # the head's row math is fp32 over the bf16 logits the matmul gives: exact to those logits; against the
    # exact fp64 logits it carries their bf16 rounding (0.012 at most here, also on CPU)
    seen = torch.log_softmax((hidden.detach() @ weight.detach().t()).double() / 0.7, -1)
    assert (entropy.double() + (seen.exp() * seen).sum(-1)).abs().max().item() < 1e-4
    assert (lp.double() - seen.gather(1, targets[:, None]).squeeze(1)).abs().max().item() < 1e-4
    assert (entropy.double() - entropy64).abs().max().item() < 0.05
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max().item() <= 0.02 * b.abs().max().item()  # bf16 inputs and gradients
