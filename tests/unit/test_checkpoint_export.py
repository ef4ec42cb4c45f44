"""HF export from a checkpoint: loads with transformers alone, generates what the learner's model does."""

import json
import random

import pytest
import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner import checkpoint, parallel
from streamrl.learner.batching import pack
from streamrl.learner.export import ExportError, export_state
from streamrl.learner.train_step import Trainer
from streamrl.ops.export import export_checkpoint

CFG = LearnerConfig(lr=5e-2)


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """A learner two steps in (large lr: its greedy outputs differ from the initial model's), checkpointed."""
    from transformers import AutoModelForCausalLM

    parallel.init_distributed()
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    trainer = Trainer(parallel.wrap_model(lm, CFG, torch.device("cpu")), LossConfig(), CFG, torch.device("cpu"))
    rng = random.Random(0)
    for step in (1, 2):
        trajs = [
            Trajectory(
                sample_id=f"s{step}-{i}",
                group_id="g",
                node_id="n",
                seq=i,
                prompt_ids=[5, 6, 7],
                completion_ids=[rng.randrange(3, 500) for _ in range(6)],
                behavior_logprobs=[-6.0] * 6,
                reward=0.0,
                policy_version=0,
            )
            for i in range(4)
        ]
        trainer.step(pack(trajs, [1.0, -1.0, 1.0, -1.0], token_budget=40))
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    state = checkpoint.LearnerState(step=2, version=trainer.version)
    path = checkpoint.save(root, trainer.model.lm, trainer.optimizer, trainer.scheduler, state, tiny_model)
    full = {k: v.clone() for k, v in parallel.full_state_dict(trainer.model).items()}
    yield path, full
    parallel.shutdown()


def greedy(model, prompts):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0].tolist() for p in prompts]


def reference_model(tiny_model, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model.eval()


def test_export_loads_in_transformers_and_generates_like_the_learner(trained, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, full = trained
    out = export_checkpoint(path, tmp_path / "export", max_shard_size="400KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for name, value in exported.state_dict().items():
        assert torch.equal(value, full[name]), name
    prompts = [[5, 6, 7], [11, 40, 2, 9], [300]]
    learner_out = greedy(reference_model(tiny_model, full), prompts)
    assert greedy(exported, prompts) == learner_out
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert greedy(initial, prompts) != learner_out  # the trained weights made a difference
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("hello world")) == AutoTokenizer.from_pretrained(tiny_model).decode(
        AutoTokenizer.from_pretrained(tiny_model).encode("hello world")
    )


def test_export_refuses_a_non_empty_folder(trained, tmp_path):
    path, full = trained
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(ExportError, match="taken exists and is not empty.*--overwrite"):
        export_checkpoint(path, tmp_path / "taken")
    assert (tmp_path / "taken" / "x").read_text() == "mine"


def test_export_of_weights_that_do_not_fit_names_them(trained, tmp_path):
    path, full = trained
    partial = {k: v for k, v in full.items() if not k.startswith("model.norm")}
    with pytest.raises(ExportError, match=r"missing \['model.norm.weight'\]"):
        export_state(partial, path / "hf", tmp_path / "out")


def test_the_export_command_says_which_step_it_exported(trained, tmp_path):
    # issue 53: given a run's checkpoints folder, export takes the newest and now says which it was
    from typer.testing import CliRunner

    from streamrl.cli import app

    path, full = trained
    result = CliRunner().invoke(app, ["export", str(path.parent), str(tmp_path / "out")], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert f"exported to {tmp_path / 'out'}: step 2 ({path})" in result.output
