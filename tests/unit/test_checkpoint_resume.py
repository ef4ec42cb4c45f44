"""Save → resume on one rank (a one-rank gloo group, the same DCP path as many ranks)."""

import json
import random

import pytest
import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner import checkpoint, parallel
from streamrl.learner.batching import pack
from streamrl.learner.train_step import Trainer

CFG = LearnerConfig(lr=1e-2, warmup_steps=3)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    parallel.init_distributed()
    yield
    parallel.shutdown()


def make_trainer(model_dir, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return Trainer(parallel.wrap_model(lm, CFG, torch.device("cpu")), LossConfig(), CFG, torch.device("cpu"))


def batch(step):
    rng = random.Random(step)
    trajs = [
        Trajectory(
            sample_id=f"s{step}-{i}",
            group_id="g",
            node_id="n",
            seq=i,
            prompt_ids=[rng.randrange(3, 500) for _ in range(4)],
            completion_ids=[rng.randrange(3, 500) for _ in range(5)],
            behavior_logprobs=[-6.0] * 5,
            reward=0.0,
            policy_version=0,
        )
        for i in range(4)
    ]
    return pack(trajs, [1.0, -1.0, 0.5, -0.5], token_budget=20)


def weights(trainer):
    return {k: v.clone() for k, v in parallel.full_state_dict(trainer.model).items()}


def optim_state(trainer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(trainer.model.lm, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    return {f"{name}.{k}": v.clone() for name, st in sd["state"].items() for k, v in st.items()}


def save(trainer, root, step, model_dir):
    state = checkpoint.LearnerState(step=step, **trainer.state_dict())
    return checkpoint.save(root, trainer.model.lm, trainer.optimizer, trainer.scheduler, state, model_dir)


def resume(path, model_dir):
    trainer = make_trainer(model_dir, seed=99)  # other init: everything must come from the checkpoint
    state = checkpoint.load(path, trainer.model.lm, trainer.optimizer, trainer.scheduler)
    trainer.load_state_dict(state.trainer_state())
    return trainer, state


def test_save_then_resume_is_bit_identical(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model)
    for step in (1, 2):
        trainer.step(batch(step))
    torch.manual_seed(1234)
    path = save(trainer, tmp_path / "checkpoints", 2, tiny_model)
    expected_draw = torch.rand(3)
    assert path.name == "step_2" and (path / "meta.json").is_file() and (path / "hf" / "tokenizer.json").is_file()
    back, state = resume(path, tiny_model)
    assert (state.step, state.version, back.version) == (2, 2, 2)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where it was saved
    before, after = weights(trainer), weights(back)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    opt_a, opt_b = optim_state(trainer), optim_state(back)
    assert len(opt_a) > 0 and opt_a.keys() == opt_b.keys()
    assert all(torch.equal(opt_a[k], opt_b[k]) for k in opt_a)
    # warm-up 3 steps: after 2 scheduler steps the factor is (2 + 1) / 3 = 1.0 → lr 1e-2
    assert back.scheduler.get_last_lr() == trainer.scheduler.get_last_lr() == [pytest.approx(1e-2)]
    assert back.scheduler.last_epoch == 2


def test_interrupted_run_ends_with_the_same_weights(tiny_model, tmp_path):
    straight = make_trainer(tiny_model)
    for step in range(1, 5):
        straight.step(batch(step))
    first = make_trainer(tiny_model)
    for step in (1, 2):
        first.step(batch(step))
    path = save(first, tmp_path / "checkpoints", 2, tiny_model)
    del first
    second, state = resume(path, tiny_model)
    for step in range(state.step + 1, 5):
        second.step(batch(step))
    a, b = weights(straight), weights(second)
    assert second.version == straight.version == 4
    assert all(torch.equal(a[k], b[k]) for k in a)
    moved = weights(make_trainer(tiny_model))
    assert any(not torch.equal(a[k], moved[k]) for k in a)  # training moved the weights: the check has teeth


def test_another_model_is_refused_naming_the_field(tiny_model, tmp_path):
    from streamrl.engine.models import make_tiny_model

    trainer = make_trainer(tiny_model)
    path = save(trainer, tmp_path / "checkpoints", 1, tiny_model)
    other = make_tiny_model(tmp_path / "wide", seed=0, hidden_size=48)
    with pytest.raises(checkpoint.CheckpointError, match=r"hidden_size = \d+ there, 48 in this run's model"):
        resume(path, str(other))


def test_meta_records_the_learner_state(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model)
    trainer.step(batch(1))
    path = save(trainer, tmp_path / "checkpoints", 7, tiny_model)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["state"]["step"] == 7 and meta["state"]["version"] == 1 and meta["state"]["world_size"] == 1
    assert meta["model"]["hidden_size"] == trainer.model.lm.config.hidden_size
    assert checkpoint.resolve("latest", tmp_path) == path
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


class _RunsCodeOnLoad:
    """What a tampered checkpoint would hold: unpickling it calls a function (here, touching a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_tampered_extra_pt_with_a_pickled_callable_is_refused_and_never_runs(tiny_model, tmp_path):
    import numpy as np

    trainer = make_trainer(tiny_model)
    np.random.seed(5)
    path = save(trainer, tmp_path / "checkpoints", 1, tiny_model)
    expected = np.random.rand(2)
    resume(path, tiny_model)  # the honest file loads with the safe loader, numpy's RNG state included
    assert np.array_equal(np.random.rand(2), expected)
    marker = tmp_path / "code-ran"
    extra = torch.load(path / "extra.pt", weights_only=True)
    torch.save({**extra, "scheduler": _RunsCodeOnLoad(marker)}, path / "extra.pt")
    torch.load(path / "extra.pt", weights_only=False)  # what the old loader did: the file's code runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"extra.pt holds objects other than tensors"):
        resume(path, tiny_model)
    assert not marker.exists()
