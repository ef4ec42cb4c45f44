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


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """Two steps of a LoRA learner, its checkpoint and that checkpoint's PEFT export (read by both tests);
    (trainer, spec, checkpoint, export folder, the learner's logprobs of IDS)."""
    folder = tmp_path_factory.mktemp("lora-ck")
    first, spec = make(tiny_model, seed=0)
    for step in (1, 2):
        first.step(batch(step))
    state = checkpoint.LearnerState(step=2, **first.state_dict())
    path = checkpoint.save(
        folder / "ck", first.model.lm, first.optimizer, first.scheduler, state, tiny_model, adapter=spec
    )
    return first, spec, path, export_checkpoint(path, folder / "peft"), learner_logprobs(first)


def test_adapter_checkpoint_resumes_bit_for_bit_and_exports_for_peft(trained, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first, spec, path, peft_dir, expected = trained
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

    # export: a PEFT adapter folder that PEFT loads onto the base model, and --merge: one HF model
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


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_serves_the_exported_adapter_as_a_lora_request(trained, tiny_model):
    """bench/RESULTS.md's claim: the PEFT folder loads in vLLM as a `LoRARequest`; its prompt logprobs are
    the learner's, and without the request (the base model) they are not."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    _, spec, _, peft_dir, expected = trained
    llm = LLM(model=tiny_model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=128, seed=0, enable_lora=True, max_lora_rank=spec.rank)  # fmt: skip
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompt = TokensPrompt(prompt_token_ids=IDS.tolist())
    adapter = LoRARequest("step_2", 1, str(peft_dir))

    outs = [llm.generate([prompt], params, lora_request=r, use_tqdm=False)[0] for r in (adapter, None)]
    del llm
    served, base = (
        torch.tensor([step[int(t)].logprob for step, t in zip(out.prompt_logprobs[1:], IDS[1:])]) for out in outs
    )
    assert (served - expected).abs().max() <= 1e-4, (served - expected).abs().max()
    assert (base - expected).abs().max() > 1e-3  # the positive control: the adapter is what moved them
