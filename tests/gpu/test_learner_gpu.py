"""The learner on CUDA: bf16 chunked head, varlen attention over packed sequences, the safe step."""

import pytest
import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner.batching import pack

pytestmark = pytest.mark.gpu


def traj(i, prompt, completion):
    return Trajectory(
        sample_id=f"s{i}",
        group_id="g",
        node_id="n",
        seq=i,
        prompt_ids=prompt,
        completion_ids=completion,
        behavior_logprobs=[-6.0] * len(completion),
        reward=0.0,
        policy_version=0,
    )


def test_chunked_head_in_bf16_matches_fp32_reference():
    from streamrl.learner.logprobs import chunked_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(3000, 256, device="cuda", requires_grad=True)
    weight = (torch.randn(20000, 256, device="cuda") * 0.05).requires_grad_(True)
    targets = torch.randint(0, 20000, (3000,), device="cuda")
    ref = torch.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None]).squeeze(1)
    h16, w16 = (x.detach().bfloat16().requires_grad_(True) for x in (hidden, weight))
    lp, entropy = chunked_logprobs(h16, w16, targets, chunk=1024)
    assert lp.dtype == torch.float32 and entropy.shape == (3000,)
    assert (lp - ref).abs().max().item() < 0.1  # bf16 inputs: ~3 significant digits per logit
    # backward: the head weight's gradient is accumulated over the three chunks in fp32 (addmm into fp32)
    ref.sum().backward()
    lp.sum().backward()
    for got, want in ((h16.grad, hidden.grad), (w16.grad, weight.grad)):
        assert (got.float() - want).abs().max().item() < 0.02 * want.abs().max().item()


def test_triton_head_kernels_match_the_row_math():
    """One-pass online softmax forward and elementwise backward against the plain fp32 row math; a vocabulary
    that is no multiple of the blocks, a sharply peaked row, targets at both ends."""
    from streamrl.learner import logprobs
    from streamrl.learner.head_kernels import head_backward, head_forward

    torch.manual_seed(0)
    logits = (torch.randn(37, 5003, device="cuda") * 3).bfloat16()
    logits[3] *= 40
    targets = torch.randint(0, 5003, (37,), device="cuda")
    targets[0], targets[1] = 5002, 0
    inv_temp = 1 / 0.7
    want = logprobs._head_forward(logits, targets, inv_temp)
    got = head_forward(logits, targets, inv_temp)
    for name, g, w in zip(("logprob", "entropy", "lse"), got, want):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-4), (name, (g - w).abs().max().item())
    grad = torch.randn(37, device="cuda")
    want_d = logprobs._head_backward(logits, targets, want[2], grad, inv_temp).float()
    got_d = head_backward(logits, targets, got[2], grad, inv_temp).float()
    assert (got_d - want_d).abs().max().item() <= 1e-2 * want_d.abs().max().item()  # bf16 rounding


def test_varlen_packed_forward_matches_each_sequence_alone(tiny_model):
    from transformers import AutoModelForCausalLM

    from streamrl.learner.attention import register_varlen_attention
    from streamrl.learner.logprobs import PolicyModel

    assert register_varlen_attention(), "this torch has no torch.nn.attention.varlen"
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    policy = PolicyModel(lm)
    trajs = [traj(0, [5, 6, 7], list(range(10, 40))), traj(1, [20, 21], list(range(50, 70)))]
    (packed,) = pack(trajs, [0.0, 0.0], 256)
    packed = packed.to("cuda")
    with torch.no_grad():
        alone = torch.cat([policy(*_args(pack([t], [0.0], 256)[0].to("cuda")))[0] for t in trajs])
        lm.config._attn_implementation = "streamrl_varlen"
        lp_packed, _ = policy(*_args(packed))
    assert (lp_packed - alone).abs().max().item() < 0.05


def test_a_varlen_forward_never_waits_for_the_gpu(tiny_model):
    """No host sync in the packed forward (transformers' packed-sequence scan read its answer on the host
    while a mask function was registered for the varlen attention)."""
    from transformers import AutoModelForCausalLM

    from streamrl.learner.attention import register_varlen_attention
    from streamrl.learner.logprobs import PolicyModel

    assert register_varlen_attention()
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    lm.config._attn_implementation = "streamrl_varlen"
    (packed,) = pack([traj(0, [5, 6, 7], list(range(10, 40))), traj(1, [20, 21], list(range(50, 70)))], [0.0, 0.0], 256)
    args = _args(packed.to("cuda"))
    PolicyModel(lm)(*args)  # warm: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, _ = PolicyModel(lm)(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert lp.shape == (packed.num_tokens,)


def _args(mb):
    return mb.input_ids, mb.position_ids, mb.targets, mb.cu_seqlens, mb.max_seqlen


def test_safe_step_on_cuda(tiny_model):
    from transformers import AutoModelForCausalLM

    from streamrl.learner import parallel
    from streamrl.learner.train_step import Trainer

    device = parallel.init_distributed()
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    cfg = LearnerConfig(lr=1e-2)
    trainer = Trainer(parallel.wrap_model(lm, cfg, device), LossConfig(), cfg, device)
    trajs = [traj(i, [3, 4, 5 + i], [10 + i, 11, 12]) for i in range(4)]
    before = {k: v.clone() for k, v in parallel.full_state_dict(trainer.model).items()}
    bad = trainer.step(pack(trajs, [1.0, float("nan"), -1.0, 0.5], 12))
    assert bad["skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in parallel.full_state_dict(trainer.model).items())
    good = trainer.step(pack(trajs, [1.0, -1.0, 1.0, -1.0], 12))
    assert good["skipped"] == 0.0 and trainer.version == 1
    parallel.shutdown()


def test_a_warmed_up_compiled_learner_never_recompiles_mid_run(compiled_trainer, steps_of_new_shapes):
    """inductor and the varlen attention (cu_seqlens and the longest sequence vary too): after
    Trainer.warm_up, steps over sizes it did not see compile nothing."""
    from streamrl.learner import parallel

    trainer = compiled_trainer("inductor", micro_batch_tokens=2048)
    assert trainer.warm_up() > 0
    assert [m["skipped"] for m in steps_of_new_shapes(trainer)] == [0.0] * 4 and trainer.version == 4
    parallel.shutdown()
