"""A LoRA run's KL reference is its own frozen base with the adapters off (learner/reference.BaseReference): no
second model is built, its logprobs are those of a reference built from model.path, the adapters go on
training, and preflight counts no reference model. CPU, one-rank FSDP2, the tiny model."""

import pytest
import torch

from streamrl.engine import lora, memory
from streamrl.engine.config import build
from streamrl.engine.messages import Trajectory
from streamrl.learner import parallel, reference
from streamrl.learner.batching import pack
from streamrl.learner.logprobs import PolicyModel
from streamrl.learner.main import _policy
from streamrl.learner.reference import BaseReference, build_reference
from streamrl.learner.train_step import Trainer, compute_logprobs

# temperature and top-p as a rollout's: the reference's logprobs are of the sampling distribution
SAMPLING = {"temperature": 0.7, "top_p": 0.9}


def _cfg(tiny_model, compile: bool = False, **loss):
    return build(
        {
            "model": {"path": tiny_model},
            "lora": {"enabled": True, "rank": 8, "alpha": 16.0},
            "loss": {"kl_coef": 0.5, **loss},
            "learner": {"lr": 5e-2, "compile": compile},
            "rollout": SAMPLING,
        }
    )


def _batch():
    trajs = [
        Trajectory(sample_id=f"s{i}", group_id=f"g{i // 2}", node_id="n", seq=i, prompt_ids=[3, 4 + i, 5],
                   completion_ids=[10 + i, 11, 12 + 2 * i, 13], behavior_logprobs=[-6.0] * 4, reward=0.0,
                   policy_version=0)
        for i in range(4)
    ]  # fmt: skip
    return pack(trajs, [1.0, -1.0, 0.5, -0.5], token_budget=14)  # two micro-batches of two sequences


@pytest.fixture(scope="module")
def run(tiny_model):
    """One run, read by the tests below: a LoRA policy built as the learner builds it, its reference from
    build_reference (every load_model call counted), a reference of its own from model.path named as
    loss.reference_path (the positive control: a separate model, loaded once), and two KL steps."""
    device = parallel.init_distributed()
    loads, load = [], reference.load_model
    cfg = _cfg(tiny_model)
    torch.manual_seed(0)
    policy, _, compute, _ = _policy(cfg, device)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reference, "load_model", lambda path, *a: loads.append(path) or load(path, *a))
        shared = build_reference(cfg, device, compute, policy)
        in_reward = build(
            {"loss": {"preset": "ppo"}, "lora": {"enabled": True}, "critic": {"kl_in_reward": 0.1}, "rollout": SAMPLING}
        )
        shared_in_reward = build_reference(in_reward, device, compute, policy)
        built_by_shared = list(loads)
        own = build_reference(_cfg(tiny_model, reference_path=tiny_model), device, compute, policy)
    trainer = Trainer(policy, cfg.loss, cfg.learner, device, ref_model=shared)
    grads = {n: p.requires_grad for n, p in policy.named_parameters()}
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    steps = [trainer.step(_batch()), trainer.step(_batch())]
    yield dict(
        trainer=trainer, shared=shared, own=own, shared_in_reward=shared_in_reward, loads=loads,
        built_by_shared=built_by_shared, grads=grads, optimized=optimized, steps=steps, device=device,
    )  # fmt: skip
    parallel.shutdown()


def test_no_second_model_is_built_for_either_kl(run, tiny_model):
    assert run["built_by_shared"] == []  # neither loss.kl_coef's nor critic.kl_in_reward's reference loaded one
    assert isinstance(run["shared"], BaseReference) and run["shared"].policy is run["trainer"].model
    assert isinstance(run["shared_in_reward"], BaseReference)
    assert run["loads"] == [tiny_model] and isinstance(run["own"], PolicyModel)  # a reference_path still loads


def test_the_base_gives_the_logprobs_of_a_reference_built_from_model_path(run):
    """After two steps the adapters have moved: the policy's logprobs are no longer the base's, while the
    adapter-off pass still equals the separately built reference to fp32 rounding."""
    trainer, shared, own = run["trainer"], run["shared"], run["own"]
    with torch.no_grad():
        for mb in _batch():
            mb = mb.to(run["device"])
            base, ref, policy = shared(*_inputs(mb)), compute_logprobs(own, mb), compute_logprobs(trainer.model, mb)
            torch.testing.assert_close(base, ref, rtol=0.0, atol=1e-5)  # logprobs and entropy
            assert (policy[0] - ref[0]).abs().max() > 1e-3
    assert run["steps"][0]["ref_kl"] == pytest.approx(0.0, abs=1e-6)  # version 0 (B = 0) is the base exactly
    assert run["steps"][1]["ref_kl"] > 1e-5


def test_the_adapters_stay_on_trainable_and_in_the_optimizer(run):
    trainer, shared = run["trainer"], run["shared"]
    policy = trainer.model
    assert trainer.version == 2 and all(s["skipped"] == 0.0 for s in run["steps"])
    assert {n: p.requires_grad for n, p in policy.named_parameters()} == run["grads"]
    assert all(g == lora.is_adapter(n) for n, g in run["grads"].items()) and any(run["grads"].values())
    assert [p for g in trainer.optimizer.param_groups for p in g["params"]] == run["optimized"]
    assert not any(layer.disable_adapters for layer in shared._off.layers) and len(shared._off.layers) > 0
    assert all(m.training for m in policy.modules())  # the reference pass's eval mode did not stay
    push = parallel.PushWeights(policy, torch.float32, adapters=True)
    before = {k: v.clone() for k, v in push().items()}
    inside = []  # the adapters' requires_grad while the reference pass runs (PEFT's own switch writes it)
    layer = shared._off.layers[0]
    hook = layer.register_forward_pre_hook(lambda m, _: inside.extend(p.requires_grad for p in m.lora_A.parameters()))
    with torch.no_grad():
        shared(*_inputs(_batch()[0].to(run["device"])))
    hook.remove()
    assert inside == [True] and layer.disable_adapters is False
    after = push()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert any(v.abs().max() > 0 for k, v in after.items() if ".lora_B." in k)  # what is pushed has moved
    with pytest.raises(RuntimeError, match="no-grad passes only"):
        shared(*_inputs(_batch()[0].to(run["device"])))


def test_compiled_layers_take_the_switch_each_way(run, tiny_model, monkeypatch):
    """learner.compile: each compiled layer guards on the LoRA layers' switch and on the mode, so the adapters-off
    pass is the base and the next policy forward has its adapters again (dynamo with the eager backend: its
    guards are what is checked, not a code generator). A graph that ignored the switch gives the policy's
    logprobs for the base or the base's for the policy."""
    import torch._dynamo
    import torch._dynamo.utils

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # conftest turns dynamo off for vLLM's sake
    torch._dynamo.reset()
    compile_with = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_with(self, backend="eager"))
    cfg = _cfg(tiny_model, compile=True)
    torch.manual_seed(0)
    policy, _, compute, _ = _policy(cfg, run["device"])
    shared = build_reference(cfg, run["device"], compute, policy)
    trainer = Trainer(policy, cfg.loss, cfg.learner, run["device"], ref_model=shared)
    first = trainer.step(_batch())  # its reference pass compiles the adapters-off graphs, its update moves B
    with torch.no_grad():
        for mb in _batch():
            inputs = _inputs(mb.to(run["device"]))
            ref = run["own"](*inputs)[0]
            before, base, after = policy(*inputs)[0], shared(*inputs)[0], policy(*inputs)[0]
            torch.testing.assert_close(base, ref, rtol=0.0, atol=1e-5)
            assert (before - ref).abs().max() > 1e-3 and torch.equal(before, after)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the layers were compiled
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-6) and first["skipped"] == 0.0
    torch._dynamo.reset()


def _inputs(mb):
    return mb.input_ids, mb.position_ids, mb.targets, mb.cu_seqlens, mb.max_seqlen


QWEN2_7B = memory.Shape(params=7_614_699_008, hidden=3584, intermediate=18944, layers=28, kv_width=512, vocab=151936)


@pytest.mark.parametrize(
    ("data", "counted"),
    [
        ({"lora": {"enabled": True}, "loss": {"kl_coef": 0.1}}, False),
        ({"lora": {"enabled": True}, "loss": {"preset": "ppo"}, "critic": {"kl_in_reward": 0.1}}, False),
        ({"lora": {"enabled": True}, "loss": {"kl_coef": 0.1, "reference_path": "models/ref"}}, True),
        ({"loss": {"kl_coef": 0.1}}, True),  # a full fine-tune moves the base: a reference of its own
    ],
)
def test_preflight_counts_a_reference_model_only_where_one_is_built(data, counted):
    # bf16 shards on one rank + the bf16 copy its pass gathers: 4 x 7,614,699,008 / 2**30 = 28.37 GiB for Qwen2-7B
    cfg = build({**data, "model": {"dtype": "bfloat16"}})
    estimate, line = memory.learner(cfg, QWEN2_7B), memory.reference_label(cfg)
    assert estimate.parts.get(line, 0.0) == pytest.approx(28.37 if counted else 0.0, abs=0.005)
    assert [k for k in estimate.parts if k.startswith("reference")] == ([line] if counted else [])
