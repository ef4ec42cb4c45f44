"""LoRA checkpoints on one rank: the adapters and their optimizer state alone, a resume that continues bit for
bit, and `streamrl export` as a PEFT adapter folder (or merged) that gives the learner's logprobs."""

import random

import pytest
import torch

from streamrl.engine.config import LearnerConfig, LoraConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner import checkpoint, parallel
from streamrl.learner import lora as learner_lora
from streamrl.learner.batching import pack
from streamrl.learner.train_step import Trainer
from streamrl.ops.export import export_checkpoint

CFG = LearnerConfig(lr=1e-2, warmup_steps=3)
LORA = LoraConfig(enabled=True, rank=8, alpha=16.0)
IDS = torch.tensor([5, 17, 230, 44, 9, 301, 77, 12, 480, 3])


@pytest.fixture(scope="module", autouse=True)
def process_group():
    parallel.init_distributed()
    yield
    parallel.shutdown()


def make(model_dir, seed):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # the adapters' A init
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    lm, spec = learner_lora.apply(lm, LORA, torch.float32)
    return Trainer(parallel.wrap_model(lm, CFG, torch.device("cpu")), LossConfig(), CFG, torch.device("cpu")), spec


def batch(step):
    rng = random.Random(step)
    trajs = [
        Trajectory(sample_id=f"s{step}-{i}", group_id="g", node_id="n", seq=i,
                   prompt_ids=[rng.randrange(3, 500) for _ in range(4)],
                   completion_ids=[rng.randrange(3, 500) for _ in range(5)],
                   behavior_logprobs=[-6.0] * 5, reward=0.0, policy_version=0)
        for i in range(4)
    ]  # fmt: skip
    return pack(trajs, [1.0, -1.0, 0.5, -0.5], token_budget=20)


def adapters(trainer):
    return {k: v.clone() for k, v in learner_lora.adapter_state(trainer.model.lm).items()}


def learner_logprobs(trainer) -> torch.Tensor:
    t = len(IDS) - 1
    with torch.no_grad():
        return trainer.model(IDS[:-1], torch.arange(t), IDS[1:], torch.tensor([0, t], dtype=torch.int32), t)[0]


def hf_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS[None]).logits[0, :-1].log_softmax(-1).gather(-1, IDS[1:, None])[:, 0]


def test_adapter_checkpoint_resumes_bit_for_bit_and_exports_for_peft(tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first, spec = make(tiny_model, seed=0)
    for step in (1, 2):
        first.step(batch(step))
    state = checkpoint.LearnerState(step=2, **first.state_dict())
    path = checkpoint.save(
        tmp_path / "ck", first.model.lm, first.optimizer, first.scheduler, state, tiny_model, adapter=spec
    )
    meta = checkpoint.read_meta(path)
    assert meta.adapter == spec and meta.base == tiny_model
    assert meta.params and all(learner_lora.lora.is_adapter(name) for name in meta.params)
    import torch.distributed.checkpoint as dcp

    saved = [k.removeprefix("model.") for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata]
    assert {k for k in saved if not k.startswith("optim.")} == set(meta.params)  # no base weight
    held = sum(f.stat().st_size for f in path.glob("*.distcp"))
    assert held < sum(p.numel() * 4 for p in first.model.parameters())  # a full checkpoint: 3x that

    resumed, _ = make(tiny_model, seed=1)  # other A: everything trained must come from the checkpoint
    restored = checkpoint.load(path, resumed.model.lm, resumed.optimizer, resumed.scheduler)
    assert (restored.step, restored.version) == (2, first.version)
    before = adapters(first)
    assert before.keys() == adapters(resumed).keys()
    assert all(torch.equal(before[k], v) for k, v in adapters(resumed).items())
    expected = learner_logprobs(first)

    # export: a PEFT adapter folder that PEFT loads onto the base model, and --merge: one HF model
    peft_dir = export_checkpoint(path, tmp_path / "peft")
    assert {f.name for f in peft_dir.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(peft_dir)).eval()
    assert (hf_logprobs(peft_model) - expected).abs().max() <= 1e-5
    merged = AutoModelForCausalLM.from_pretrained(str(export_checkpoint(path, tmp_path / "merged", merge=True)))
    assert (hf_logprobs(merged.eval()) - expected).abs().max() <= 1e-5

    for trainer in (first, resumed):  # the next step continues identically
        trainer.step(batch(3))
    after = adapters(first)
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert all(torch.equal(after[k], v) for k, v in adapters(resumed).items())
