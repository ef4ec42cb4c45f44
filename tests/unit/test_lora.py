"""LoRA on the learner (CPU, one-rank FSDP2): the [lora] section, its checks against a model, PEFT adapters that
train while the base stays bit-identical, and a push that holds the adapters alone."""

import pytest
import torch

from streamrl.engine import lora
from streamrl.engine.config import ConfigError, LearnerConfig, LoraConfig, LossConfig, build
from streamrl.learner import lora as learner_lora
from streamrl.learner import parallel
from streamrl.learner.batching import pack
from streamrl.learner.train_step import Trainer

ALL = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_lora_is_off_by_default_and_bad_values_name_the_field():
    assert build({}).lora.enabled is False
    assert build({"lora": {"enabled": True}}).lora.target_modules == ["all-linear"]
    with pytest.raises(ConfigError, match=r"lora\.rank"):
        build({"lora": {"rank": 0}})
    with pytest.raises(ConfigError, match=r"lora\.rank = 1024 is above 512"):
        build({"lora": {"rank": 1024}})
    with pytest.raises(ConfigError, match=r"lora\.target_modules is empty"):
        build({"lora": {"target_modules": []}})
    with pytest.raises(ConfigError, match=r"lora\.alpha"):
        build({"lora": {"alpha": -1.0}})


@pytest.fixture(scope="module")
def hf_config(tiny_model):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model)


def test_targets_resolve_against_the_model_and_mistakes_name_the_field(hf_config):
    # tiny Qwen2: hidden 64, intermediate 128, 2 heads x 32, 1 kv head: k_proj/v_proj are 64 -> 32
    assert lora.spec_for(LoraConfig(enabled=True), hf_config).target_modules == ALL
    spec = lora.spec_for(LoraConfig(enabled=True, rank=32, target_modules=["q_proj", "v_proj"]), hf_config)
    assert (spec.rank, spec.target_modules) == (32, ["q_proj", "v_proj"])
    with pytest.raises(lora.LoraError, match=r"lora\.target_modules = \['qkv_proj'\].*no linear module.*q_proj"):
        lora.spec_for(LoraConfig(target_modules=["qkv_proj"]), hf_config)
    with pytest.raises(lora.LoraError, match=r"lora\.target_modules.*'lm_head'"):  # never adapted
        lora.spec_for(LoraConfig(target_modules=["lm_head"]), hf_config)
    with pytest.raises(lora.LoraError, match=r"lora\.rank = 33 does not fit: the smallest target side is 32 \(k_"):
        lora.spec_for(LoraConfig(rank=33), hf_config)
    assert [lora.engine_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]


def test_names_on_the_wire_are_peft_saved_names():
    inside = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    wire = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lora.wire_name(inside) == wire and lora.param_name(wire) == inside
    assert lora.is_adapter(inside) and not lora.is_adapter("model.layers.0.self_attn.q_proj.base_layer.weight")


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from transformers import AutoModelForCausalLM

    device = parallel.init_distributed()
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    lm, spec = learner_lora.apply(lm, LoraConfig(enabled=True, rank=8, alpha=16.0), torch.float32)
    cfg = LearnerConfig(lr=1e-2)
    model = parallel.wrap_model(lm, cfg, device)
    yield Trainer(model, LossConfig(), cfg, device), spec
    parallel.shutdown()


def _batch(advantages):
    from streamrl.engine.messages import Trajectory

    trajs = [
        Trajectory(sample_id=f"s{i}", group_id="g", node_id="n", seq=i, prompt_ids=[3, 4, 5 + i],
                   completion_ids=[10 + i, 11, 12], behavior_logprobs=[-6.0] * 3, reward=0.0, policy_version=0)
        for i in range(len(advantages))
    ]  # fmt: skip
    return pack(trajs, advantages, token_budget=12)


def test_only_the_adapters_train_and_only_they_are_pushed(trainer):
    trainer, spec = trainer
    lm = trainer.model.lm
    trained = {n for n, _ in trainer.named_params}
    assert trained and all(lora.is_adapter(n) for n in trained)
    assert len(trained) == 2 * len(spec.target_modules) * lm.config.num_hidden_layers  # A and B per module
    base = {k: v.clone() for k, v in parallel.full_state_dict(trainer.model).items() if not lora.is_adapter(k)}
    push = parallel.PushWeights(trainer.model, torch.float32, adapters=True)
    before = {k: v.clone() for k, v in push().items()}
    assert all(k.startswith("base_model.model.model.layers.") and ".default." not in k for k in before)
    assert len(before) == len(trained)
    assert all(v.abs().max() == 0 for k, v in before.items() if ".lora_B." in k)  # version 0 = the base model

    metrics = trainer.step(_batch([1.0, -1.0, 0.5, -0.5]))
    assert metrics["skipped"] == 0.0 and trainer.version == 1
    after_base = {k: v for k, v in parallel.full_state_dict(trainer.model).items() if not lora.is_adapter(k)}
    assert base.keys() == after_base.keys() and all(torch.equal(base[k], after_base[k]) for k in base)
    after = push()
    assert any(v.abs().max() > 0 for k, v in after.items() if ".lora_B." in k)
    assert {p.dtype for _, p in trainer.named_params} == {torch.float32}  # fp32 here; bf16 below
    full = sum(p.numel() for p in lm.parameters())
    assert sum(v.numel() for v in after.values()) < 0.2 * full


def test_a_bf16_base_stays_bf16_and_frozen_while_its_adapters_train_in_fp32(tiny_model):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    lm, _ = learner_lora.apply(lm, LoraConfig(enabled=True, rank=8, alpha=16.0), torch.bfloat16)
    dtypes = {(lora.is_adapter(n), p.dtype, p.requires_grad) for n, p in lm.named_parameters()}
    assert dtypes == {(False, torch.bfloat16, False), (True, torch.float32, True)}


def _preflight(tiny_model, *sets):
    import time

    from streamrl.ops import preflight as pf

    cfg = build({}, [f"model.path={tiny_model!r}", "run.device='cpu'", "lora.enabled=true", *sets])
    start = time.perf_counter()
    found = pf.preflight(cfg)
    assert time.perf_counter() - start < 10.0, found.seconds
    return [p.message for p in found.errors if p.check == "lora"]


def test_preflight_refuses_bad_lora_in_seconds_naming_the_field(tiny_model):
    assert _preflight(tiny_model) == []
    (unknown,) = _preflight(tiny_model, "lora.target_modules=['q_proj', 'wq']")
    assert "lora.target_modules" in unknown and "['wq']" in unknown
    (big,) = _preflight(tiny_model, "lora.rank=64")
    assert big.startswith("lora.rank = 64 does not fit")


def test_vllm_without_lora_for_an_architecture_is_named():
    from transformers import GPT2Config, Qwen2Config

    from streamrl.rollout.backends.vllm_support import lora_problem

    assert lora_problem(Qwen2Config(architectures=["Qwen2ForCausalLM"])) == ""
    assert "GPT2LMHeadModel" in lora_problem(GPT2Config(architectures=["GPT2LMHeadModel"]))
