"""A checkpoint's room on disk: the estimate (`checkpoint.estimate_bytes`, what the learner checks the disk
for) is within 2x of what `du` counts for a real one; on a disk with room for two, a save that does not fit is
skipped with a warning and training goes on, the last step's is an error, and one that fills the disk
while it is written leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from streamrl.engine.config import CheckpointConfig, LearnerConfig, LossConfig
from streamrl.learner import checkpoint, parallel
from streamrl.learner.train_step import Trainer


def _du(folder) -> int:
    """What `du` counts: the blocks each file takes."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(folder) for f in files)


def _bigger_model(folder, tiny_model) -> str:
    """4 layers of width 256 (3.6M parameters, an untied head) with the tiny model's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("model", ["tiny", "4x256"])
def test_the_estimate_is_within_2x_of_a_real_checkpoint(model, tmp_path, tiny_model, steps_of_new_shapes):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model if model == "tiny" else _bigger_model(tmp_path / "model", tiny_model)
    device = parallel.init_distributed()
    try:
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        cfg = LearnerConfig(lr=1e-2, compile=False)
        trainer = Trainer(parallel.wrap_model(lm, cfg, device), LossConfig(), cfg, device)
        steps_of_new_shapes(trainer, steps=1)  # AdamW's moments exist after a step, as at every save of a run
        keeper = checkpoint.Keeper(CheckpointConfig(every=1), tmp_path / "run", trainer.model.lm, trainer,
                                   model_dir, last_step=1)  # fmt: skip
        keeper.after_step(1, trainer.model)
    finally:
        parallel.shutdown()
    du = _du(keeper.root / "step_1")
    figure = {"test": "checkpoint_estimate", "model": model, "estimate_bytes": keeper.need, "du_bytes": du}
    print(f"FIGURE {json.dumps({**figure, 'ratio': round(keeper.need / du, 3)})}")
    assert 0.5 <= keeper.need / du <= 2.0, (keeper.need, du)


@pytest.fixture(scope="module")
def small_disk_saves(tmp_path_factory, small_disk, tiny_model) -> dict:
    folder = tmp_path_factory.mktemp("checkpoint_disk")
    disk = folder / "disk"
    disk.mkdir()
    worker = os.path.join(os.path.dirname(__file__), "checkpoint_disk_worker.py")
    command = [*small_disk(disk, 4608), sys.executable, worker, str(folder), str(disk), tiny_model]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "KEEP": ""})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads((folder / "checkpoints.json").read_text())


def test_a_save_that_does_not_fit_is_skipped_with_a_warning_and_training_goes_on(small_disk_saves):
    steps = small_disk_saves["steps"]
    assert [steps[s] for s in ("1", "2", "3", "4")] == ["saved", "saved", "skipped", "skipped"], steps
    skipped = [w for w in small_disk_saves["warnings"] if "was skipped (training goes on)" in w]
    assert len(skipped) == 2 and "not enough disk for a checkpoint" in skipped[0], small_disk_saves["warnings"]


def test_the_last_steps_save_that_does_not_fit_is_an_error(small_disk_saves):
    assert small_disk_saves["steps"]["5"].startswith("error: not enough disk for a checkpoint"), small_disk_saves


def test_a_save_that_fills_the_disk_while_written_leaves_nothing_behind(small_disk_saves):
    assert (
        "was skipped" in small_disk_saves["forced_warning"]
        and "the disk filled up" in small_disk_saves["forced_warning"]
    )
    assert small_disk_saves["left_behind"] == ["step_1", "step_2"]  # no .tmp-step_6
    assert small_disk_saves["free_after"] >= small_disk_saves["free_before"] - 64 * 1024  # its room given back
