"""A LoRA critic (critic.lora; learner/critic/model.adapt), on the tiny model, one rank: adapters and the head train on
a frozen base kept in the compute dtype; `auto` follows the actor's [lora]; a checkpoint holds the adapters and the
head alone (with the adapter's spec and the base's folder) and a resume restores them and their AdamW state
bit-exact; `streamrl export --critic` merges the adapters into the base and writes a value model whose values are
the live critic's."""

import pytest
import torch

from streamrl.engine import lora
from streamrl.engine.config import build
from streamrl.learner import checkpoint, parallel
from streamrl.learner.batching import pack
from streamrl.learner.critic.trainer import build_shaper
from streamrl.learner.train_step import Trainer
from streamrl.ops.export import export_checkpoint
from tests.unit.test_critic_trainer import critic_state, same, samples

CPU = torch.device("cpu")
RETURNS = [0.0, 1.0, 0.0, 1.0]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    parallel.init_distributed()
    yield
    parallel.shutdown()


def config(tiny_model, *sets):
    base = [f"model.path={tiny_model!r}", "run.device='cpu'", "loss.preset='ppo'", "critic.lr=1e-2"]
    return build({}, [*base, "lora.rank=4", "lora.alpha=8.0", *sets])


def kinds(model) -> set[tuple[str, torch.dtype, bool]]:
    """(adapter / head / base, dtype, trains) of every parameter."""
    out = set()
    for name, param in model.named_parameters():
        kind = "adapter" if lora.is_adapter(name) else "head" if ".score." in name else "base"
        out.add((kind, param.dtype, param.requires_grad))
    return out


def test_auto_follows_the_actor_and_the_base_stays_frozen_in_the_compute_dtype(tiny_model):
    full = build_shaper(config(tiny_model, "lora.enabled=false"), CPU, torch.float32)
    assert kinds(full.model) == {("base", torch.float32, True), ("head", torch.float32, True)} and full.adapter is None
    shaper = build_shaper(config(tiny_model, "lora.enabled=true"), CPU, torch.bfloat16)
    assert kinds(shaper.model) == {
        ("base", torch.bfloat16, False),
        ("adapter", torch.float32, True),
        ("head", torch.float32, True),
    }
    assert shaper.adapter.rank == 4 and "score" not in shaper.adapter.target_modules
    trained = sum(p.numel() for p in shaper.optimizer.param_groups[0]["params"])
    assert trained < 0.2 * sum(p.numel() for p in shaper.model.parameters())  # AdamW holds the adapters and head
    off = build_shaper(config(tiny_model, "lora.enabled=true", "critic.lora=false"), CPU, torch.bfloat16)
    assert kinds(off.model) == {("base", torch.float32, True), ("head", torch.float32, True)}  # asked for in full


def trainer(tiny_model):
    from transformers import AutoModelForCausalLM

    cfg = config(tiny_model, "critic.lora=true")  # a full actor, a LoRA critic
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    actor = parallel.wrap_model(lm, cfg.learner, CPU)
    return Trainer(actor, cfg.loss, cfg.learner, CPU, shaper=build_shaper(cfg, CPU, torch.float32))


def base_weights(model) -> dict[str, torch.Tensor]:
    full = parallel.full_state_dict(model)
    return {k: v.clone() for k, v in full.items() if ".base_layer." in k or "embed" in k}


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A LoRA critic trained 6 steps, saved; its checkpoint's folder and its values on the batch."""
    t = trainer(tiny_model)
    before = base_weights(t.shaper.model)
    losses = [t.step(pack(samples(), RETURNS, token_budget=64))["critic/vf_loss"] for _ in range(6)]
    state = checkpoint.LearnerState(step=6, **t.state_dict())
    root = tmp_path_factory.mktemp("ckpt") / "checkpoints"
    path = checkpoint.save(root, t.model.lm, t.optimizer, t.scheduler, state, tiny_model, critic=t.shaper)
    values = t.shaper.values(pack(samples(), RETURNS, token_budget=64)[0])
    return t, path, values, before, losses


def test_the_adapters_and_head_learn_the_returns_and_the_base_never_moves(saved):
    t, _, values, before, losses = saved
    assert losses[-1] < 0.5 * losses[0], losses
    assert any(".base_layer." in k for k in before) and any("embed" in k for k in before), sorted(before)[:4]
    same(before, base_weights(t.shaper.model))
    trained = parallel.full_state_dict(t.shaper.model)
    assert any(v.abs().max() > 0 for k, v in trained.items() if ".lora_B." in k)  # the adapters moved, from B = 0
    assert torch.count_nonzero(values) > 0  # away from the zero head it started with


def test_a_checkpoint_holds_the_adapters_and_head_and_a_resume_restores_them_bit_exact(saved, tiny_model):
    t, path, _, _, _ = saved
    meta = checkpoint.read_meta(path)
    assert meta.critic and all(lora.is_adapter(k) or k.endswith("score.weight") for k in meta.critic), meta.critic
    assert meta.critic_adapter == t.shaper.adapter and meta.critic_base == str(checkpoint.local_path(tiny_model))
    fresh = trainer(tiny_model)
    state = checkpoint.load(path, fresh.model.lm, fresh.optimizer, fresh.scheduler, critic=fresh.shaper)
    fresh.load_state_dict(state.trainer_state())
    for a, b in zip(critic_state(t), critic_state(fresh)):
        same(a, b)
    assert fresh.shaper.steps == 6
    t.step(pack(samples(), RETURNS, token_budget=64))
    fresh.step(pack(samples(), RETURNS, token_budget=64))
    for a, b in zip(critic_state(t), critic_state(fresh)):
        same(a, b)


def test_export_critic_merges_the_adapters_into_the_base(saved, tmp_path):
    from transformers import AutoModelForSequenceClassification

    _, path, values, _, _ = saved
    out = export_checkpoint(path, tmp_path / "critic", critic=True)
    net = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    assert not any("lora" in name for name, _ in net.named_parameters())  # a plain value model
    mb = pack(samples(), RETURNS, token_budget=64)[0]
    with torch.no_grad():
        hidden = net.model(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)
        exported = net.score(hidden.last_hidden_state[0]).squeeze(-1)
    assert torch.allclose(exported, values, atol=1e-5), (exported - values).abs().max()
    missing = tmp_path / "nowhere"
    with pytest.raises(Exception, match="needs the base its adapters were trained on"):
        export_checkpoint(path, tmp_path / "again", critic=True, base=str(missing))


def test_a_checkpoint_of_a_full_critic_is_refused_by_a_lora_one_naming_the_setting(saved, tiny_model, tmp_path):
    from tests.unit.test_critic_trainer import trainer as full_trainer

    full = full_trainer(tiny_model)
    full.step(pack(samples(), RETURNS, token_budget=64))
    state = checkpoint.LearnerState(step=1, **full.state_dict())
    path = checkpoint.save(tmp_path, full.model.lm, full.optimizer, full.scheduler, state, tiny_model,
                           critic=full.shaper)  # fmt: skip
    lora_run = trainer(tiny_model)
    with pytest.raises(checkpoint.CheckpointError, match="holds a full critic.*critic.lora = false"):
        checkpoint.load(path, lora_run.model.lm, lora_run.optimizer, lora_run.scheduler, critic=lora_run.shaper)
    _, lora_path, _, _, _ = saved
    with pytest.raises(checkpoint.CheckpointError, match="holds a LoRA critic's adapters.*critic.lora = true"):
        checkpoint.load(lora_path, full.model.lm, full.optimizer, full.scheduler, critic=full.shaper)
