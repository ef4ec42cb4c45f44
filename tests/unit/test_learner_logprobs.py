import math

import pytest
import torch

from streamrl.engine.messages import Trajectory
from streamrl.learner.batching import pack
from streamrl.learner.logprobs import PolicyModel, chunked_logprobs


@pytest.mark.parametrize("keep_logits_bytes", [0, 2**20], ids=["recompute", "keep"])
def test_chunked_logprobs_match_log_softmax_and_its_gradient(keep_logits_bytes):
    torch.manual_seed(0)
    hidden = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    g = torch.randn(10, dtype=torch.float64)

    logits = (hidden @ weight.t()) / 0.7
    ref = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    p = torch.softmax(logits, -1)
    ref_entropy = -(p * torch.log_softmax(logits, -1)).sum(-1)
    ref_grads = torch.autograd.grad((ref * g).sum(), (hidden, weight))

    lp, entropy = chunked_logprobs(
        hidden,
        weight,
        targets,
        chunk=3,
        temperature=0.7,  # chunks 3+3+3+1
        keep_logits_bytes=keep_logits_bytes,
    )
    grads = torch.autograd.grad((lp * g).sum(), (hidden, weight))
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    assert torch.allclose(entropy.double(), ref_entropy, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("keep_logits_bytes", [0, 2**20], ids=["recompute", "keep"])
@pytest.mark.parametrize("use_logprobs", [True, False], ids=["both", "entropy-only"])
def test_entropy_gradient_matches_torch_autograd(keep_logits_bytes, use_logprobs):
    """The head's backward adds dH/dz = -p (z - (lse - H)) / T when the loss uses the entropy (the
    entropy bonus): the same gradients as autograd through log_softmax, on a 50-token vocabulary."""
    torch.manual_seed(1)
    hidden = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    g, g_entropy = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)

    log_p = torch.log_softmax((hidden @ weight.t()) / 0.7, -1)
    ref_lp, ref_entropy = log_p.gather(1, targets[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(-1)
    ref_loss = (ref_entropy * g_entropy).sum() + ((ref_lp * g).sum() if use_logprobs else 0.0)
    ref_grads = torch.autograd.grad(ref_loss, (hidden, weight))

    lp, entropy = chunked_logprobs(
        hidden, weight, targets, chunk=3, temperature=0.7, keep_logits_bytes=keep_logits_bytes
    )
    loss = (entropy * g_entropy).sum() + ((lp * g).sum() if use_logprobs else 0.0)
    grads = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert (grads[0] - torch.autograd.grad((lp * g).sum(), hidden)[0]).abs().max() > 1e-3  # the term is there


def test_entropy_gradient_of_one_row_by_hand():
    """Two logits z = (0, ln 3), T = 1: p = (1/4, 3/4), H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623,
    E_p[z] = 3/4 ln 3 = 0.8240. dH/dz_0 = -p_0 (z_0 - E_p[z]) = -0.25 * (0 - 0.8240) = 0.2060,
    dH/dz_1 = -0.75 * (1.0986 - 0.8240) = -0.2060 (they sum to 0: a softmax is shift-invariant)."""
    hidden = torch.tensor([[1.0]], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor([[0.0], [math.log(3.0)]], dtype=torch.float64, requires_grad=True)
    _, entropy = chunked_logprobs(hidden, weight, torch.tensor([0]), chunk=1)
    assert entropy.item() == pytest.approx(0.5623, abs=1e-4)
    (d_weight,) = torch.autograd.grad(entropy.sum(), weight)  # dH/dW_v = dH/dz_v * hidden = dH/dz_v
    assert d_weight[:, 0].tolist() == pytest.approx([0.2060, -0.2060], abs=1e-4)


def traj(sid, prompt, completion):
    return Trajectory(
        sample_id=sid,
        group_id="g",
        node_id="n",
        seq=0,
        prompt_ids=prompt,
        completion_ids=completion,
        behavior_logprobs=[0.0] * len(completion),
        reward=0.0,
        policy_version=0,
    )


def test_packed_forward_equals_each_sequence_alone(tiny_model):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    policy = PolicyModel(lm, chunk=4)
    a, b = traj("a", [5, 6, 7], [8, 9, 10, 11]), traj("b", [20, 21], [22, 23, 24])
    with torch.no_grad():
        (packed,) = pack([a, b], [0.0, 0.0], 64)
        lp_packed, _ = policy(
            packed.input_ids, packed.position_ids, packed.targets, packed.cu_seqlens, packed.max_seqlen
        )
        alone = []
        for t in (a, b):
            (mb,) = pack([t], [0.0], 64)
            alone.append(policy(mb.input_ids, mb.position_ids, mb.targets, mb.cu_seqlens, mb.max_seqlen)[0])
        # the reference: HF's own logits of the sequence run alone
        logits = lm(torch.tensor([[20, 21, 22, 23, 24]])).logits[0, :-1]
        hf_b = torch.log_softmax(logits, -1).gather(1, torch.tensor([[21], [22], [23], [24]])).squeeze(1)
    assert torch.allclose(lp_packed, torch.cat(alone), atol=1e-5)
    assert torch.allclose(alone[1], hf_b, atol=1e-5)


def test_kept_logits_save_the_backward_head_matmul():
    from torch.utils.flop_counter import FlopCounterMode

    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(40, 8, requires_grad=True)
    targets = torch.randint(0, 40, (12,))

    def backward_flops(keep_logits_bytes):
        lp, _ = chunked_logprobs(hidden, weight, targets, chunk=5, keep_logits_bytes=keep_logits_bytes)
        with FlopCounterMode(display=False) as counter:
            lp.sum().backward()
        return counter.get_total_flops()

    # recompute: logits, d_hidden, d_weight = 3 x (2 * 12 * 8 * 40) FLOPs; kept: the last two only
    assert backward_flops(0) == 3 * 2 * 12 * 8 * 40
    assert backward_flops(12 * 40 * 4) == 2 * 2 * 12 * 8 * 40
    assert backward_flops(12 * 40 * 4 - 1) == 3 * 2 * 12 * 8 * 40  # one byte short of fitting: recompute
