"""The safe step on one rank (a one-rank gloo group, the same FSDP2 path as many ranks)."""

import math

import pytest
import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner import parallel
from streamrl.learner.batching import pack
from streamrl.learner.train_step import Trainer, compute_logprobs


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from transformers import AutoModelForCausalLM

    device = parallel.init_distributed()
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    model = parallel.wrap_model(lm, LearnerConfig(lr=1e-2), device)
    yield Trainer(model, LossConfig(), LearnerConfig(lr=1e-2), device)
    parallel.shutdown()


def batch(advantages):
    trajs = [
        Trajectory(
            sample_id=f"s{i}",
            group_id="g",
            node_id="n",
            seq=i,
            prompt_ids=[3, 4, 5 + i],
            completion_ids=[10 + i, 11, 12],
            behavior_logprobs=[-6.0] * 3,
            reward=0.0,
            policy_version=0,
        )
        for i in range(len(advantages))
    ]
    return pack(trajs, advantages, token_budget=12)


def weights(model):
    return {k: v.clone() for k, v in parallel.full_state_dict(model).items()}


def test_planted_nan_skips_the_step_and_leaves_weights_bit_identical(trainer, caplog):
    before = weights(trainer.model)
    version = trainer.version
    with caplog.at_level("WARNING", logger="streamrl.learner"):
        metrics = trainer.step(batch([1.0, float("nan"), -1.0, 0.5]))
    assert metrics["skipped"] == 1.0 and metrics["skipped_steps"] == 1.0
    assert not math.isfinite(metrics["grad_norm"])
    after = weights(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.version == version
    assert all(p.grad is None for p in trainer.model.parameters())
    assert "non-finite gradients in" in caplog.text and "model.layers.0." in caplog.text
    # the next finite batch trains: weights move, gradient norm clipped to 1.0 by default
    metrics = trainer.step(batch([1.0, -1.0, 1.0, -1.0]))
    assert metrics["skipped"] == 0.0 and trainer.version == version + 1
    assert any(not torch.equal(before[k], v) for k, v in weights(trainer.model).items())
    assert all(torch.isfinite(v).all() for v in weights(trainer.model).values())


def optimizer_state(trainer):
    return {i: {k: v.clone() for k, v in state.items()} for i, state in enumerate(trainer.optimizer.state.values())}


def test_an_all_zero_advantage_step_leaves_weights_optimizer_state_and_version_bit_identical(trainer, caplog):
    """AdamW on a zero gradient still moves every weight by its momentum (the demo at max_staleness 4 saw
    max |dw| = 0.0067 on such a step): the update is skipped on the device, nothing moves, nothing is pushed."""
    assert trainer.step(batch([1.0, -1.0, 0.5, -0.5]))["skipped"] == 0.0  # momentum to lose
    weights_before, state_before = weights(trainer.model), optimizer_state(trainer)
    version, lr_epoch, counted = trainer.version, trainer.scheduler.last_epoch, trainer.no_gradient_updates
    assert any(state["exp_avg"].abs().max() > 0 for state in state_before.values())
    with caplog.at_level("WARNING", logger="streamrl.learner"):
        metrics = trainer.step(batch([0.0, 0.0, 0.0, 0.0]))
    assert metrics["grad_norm"] == 0.0 and metrics["skipped"] == 1.0 and metrics["updates"] == 0.0
    assert metrics["skipped_no_gradient"] == 1.0 and metrics["skipped_nonfinite"] == 0.0
    assert metrics["no_gradient_updates"] == counted + 1 and trainer.no_gradient_updates == counted + 1
    assert all(torch.equal(weights_before[k], v) for k, v in weights(trainer.model).items())
    state_after = optimizer_state(trainer)
    assert state_after.keys() == state_before.keys()
    for i, state in state_before.items():  # exp_avg, exp_avg_sq and the step count, bit for bit
        assert all(torch.equal(v, state_after[i][k]) for k, v in state.items())
    assert trainer.version == version and metrics["version"] == float(version)
    assert trainer.scheduler.last_epoch == lr_epoch
    assert all(p.grad is None for p in trainer.model.parameters())
    assert "non-finite" not in caplog.text  # not a fault: counted, not warned


def test_a_step_left_without_samples_takes_no_update(trainer):
    """Dynamic sampling can leave a step empty (every group flat within the refill bound): no forward, no update."""
    weights_before, version, counted = weights(trainer.model), trainer.version, trainer.no_gradient_updates
    metrics = trainer.step([], global_token_count=0)
    assert metrics["skipped"] == 1.0 and metrics["skipped_no_gradient"] == 1.0 and metrics["updates"] == 0.0
    assert metrics["tokens"] == 0.0 and metrics["positions"] == 0.0 and "mismatch_kl" not in metrics
    assert trainer.version == version and trainer.no_gradient_updates == counted + 1
    assert all(torch.equal(weights_before[k], v) for k, v in weights(trainer.model).items())


def test_warm_up_runs_the_step_shapes_and_leaves_weights_optimizer_and_version_alone(trainer):
    before, version = weights(trainer.model), trainer.version
    moments = {id(p): {k: v.clone() for k, v in state.items()} for p, state in trainer.optimizer.state.items()}
    assert trainer.warm_up() > 0
    assert all(torch.equal(before[k], v) for k, v in weights(trainer.model).items())
    assert trainer.version == version and all(p.grad is None for p in trainer.model.parameters())
    after = {id(p): state for p, state in trainer.optimizer.state.items()}
    assert after.keys() == moments.keys()
    assert all(torch.equal(v, after[key][k]) for key, state in moments.items() for k, v in state.items())
    assert trainer.step(batch([1.0, -1.0, 1.0, -1.0]))["skipped"] == 0.0  # and the next step trains


def test_a_warmed_up_compiled_learner_never_recompiles_mid_run(trainer, compiled_trainer, steps_of_new_shapes):
    """dynamo's guards and symbolic sizes on CPU (aot_eager: inductor's CPU build would take minutes);
    tests/gpu runs the same with inductor and the varlen attention. Without the warm-up, the second
    size met mid-run recompiles (a 7-9 s step on the H200 pair, bench/RESULTS.md)."""
    import torch._dynamo

    cold = compiled_trainer("aot_eager", micro_batch_tokens=1024)
    with pytest.raises(torch._dynamo.exc.RecompileError, match="size mismatch"):
        steps_of_new_shapes(cold)
    torch._dynamo.reset()
    warm = compiled_trainer("aot_eager", micro_batch_tokens=1024)
    assert warm.warm_up() > 0
    assert [m["skipped"] for m in steps_of_new_shapes(warm)] == [0.0] * 4 and warm.version == 4


def test_first_step_on_own_logprobs_has_ratio_one_and_tiny_kl(trainer):
    mbs = batch([1.0, -1.0, 0.5, -0.5])
    with torch.no_grad():
        for mb in mbs:
            lp, _ = compute_logprobs(trainer.model, mb)
            mb.behavior_logprobs = torch.where(mb.loss_mask, lp, torch.zeros_like(lp))
            mb.versions = torch.where(mb.loss_mask, trainer.version, -1)
    metrics = trainer.step(mbs)
    assert metrics["tokens"] == 12.0 and metrics["positions"] == 20.0
    assert metrics["is_weight_max"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["is_weight_min"] == pytest.approx(1.0, abs=1e-6)
    assert abs(metrics["ppo_kl"]) < 1e-6 and metrics["mismatch_kl"] < 1e-6
    assert metrics["clip_fraction"] == 0.0 and metrics["entropy"] > 0.0
    # ratio 1 everywhere: loss = -mean advantage over the 12 loss tokens = -(3 - 3 + 1.5 - 1.5) / 12 = 0
    assert metrics["loss"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["grad_norm"] > 0.0


def test_skip_names_only_the_parameters_whose_gradients_are_not_finite(trainer, caplog):
    """A NaN planted in the first layer's MLP backward reaches layer 0 and the embedding, nothing later;
    the norm is not used to clip (that would spread NaN to every gradient before they are named)."""
    mlp = trainer.model.lm.model.layers[0].mlp
    handle = mlp.register_full_backward_pre_hook(lambda module, grad_out: (torch.full_like(grad_out[0], math.nan),))
    before = weights(trainer.model)
    try:
        with caplog.at_level("WARNING", logger="streamrl.learner"):
            metrics = trainer.step(batch([1.0, -1.0, 1.0, -1.0]))
    finally:
        handle.remove()
    assert metrics["skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in weights(trainer.model).items())
    layer0 = {k for k in before if k.startswith("model.layers.0.")}
    assert set(trainer.last_nonfinite) == layer0 | {"model.embed_tokens.weight"}
    assert "model.layers.0.input_layernorm.weight" in caplog.text


def test_layer_units_group_consecutive_layers_by_parameter_count():
    from streamrl.learner.parallel import layer_units

    assert layer_units([10] * 6, 25) == [[0, 1, 2], [3, 4, 5]]
    assert layer_units([10] * 6, 20) == [[0, 1], [2, 3], [4, 5]]
    assert layer_units([10] * 7, 20) == [[0, 1], [2, 3], [4, 5, 6]]  # the remainder joins the last unit
    assert layer_units([10] * 6, 1) == [[i] for i in range(6)]
    assert layer_units([10] * 6, 60) == [] and layer_units([10] * 6, 10**9) == []  # one unit: the root holds all


def test_the_forward_after_a_step_sees_the_updated_weights(trainer, tiny_model):
    """The step gathers the next forward's parameters right after the optimizer (gather_for_next_forward);
    that forward must use the new weights: the same logprobs as a plain copy of the model built from the
    trained state dict."""
    from transformers import AutoModelForCausalLM

    from streamrl.learner.logprobs import PolicyModel

    assert trainer.step(batch([1.0, -1.0, 1.0, -1.0]))["skipped"] == 0.0
    mb = batch([1.0, -1.0, 1.0, -1.0])[0]
    with torch.no_grad():
        after_step, _ = compute_logprobs(trainer.model, mb)  # before anything reshards the gathered copy
        plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
        plain.load_state_dict(weights(trainer.model))
        reference, _ = compute_logprobs(PolicyModel(plain), mb)
    assert (after_step - reference).abs().max().item() < 1e-5


def test_push_weights_read_the_live_parameters_under_hf_names_after_every_step(trainer):
    push = parallel.PushWeights(trainer.model, torch.float32)
    names = [parallel.hf_name(n) for n, _ in trainer.model.lm.named_parameters(remove_duplicate=False)]
    for advantages in ([1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, 0.5, -0.5]):
        trainer.step(batch(advantages))  # gathered ahead: the slots hold FSDP's unsharded tensors
        pushed = push()
        assert list(pushed) == names
        assert all(t.dtype == torch.float32 for t in pushed.values())
        copies = {k: v.clone() for k, v in pushed.items()}
        state = weights(trainer.model)  # resharded now: the next call reads sharded tensors, gathers them
        assert all(torch.equal(copies[k], state[k]) for k in state)
        assert all(torch.equal(v, copies[k]) for k, v in push().items())
    halves = parallel.PushWeights(trainer.model, torch.bfloat16)()
    assert {t.dtype for t in halves.values()} == {torch.bfloat16}
    assert torch.equal(halves[names[0]], copies[names[0]].to(torch.bfloat16))
