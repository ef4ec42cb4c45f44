"""The one-GPU examples at users' sizes (examples/gpu-1.5b.toml, gpu-7b-lora.toml): their split of an 80 GB GPU,
their reward, and `make-tiny-model --shape NAME:152k` that makes their models."""

from __future__ import annotations

import json
import pathlib

import pytest

from streamrl.engine import memory
from streamrl.engine.config import load
from streamrl.engine.models import SHAPES
from streamrl.rewards.registry import resolve

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
H100_GIB = 79.1  # what torch reports of an H100 80GB (bench/RESULTS.md)


def _cfg(tmp_path, name: str, shape: str):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=151936, max_position_embeddings=32768, **SHAPES[shape]).save_pretrained(tmp_path)
    return load(EXAMPLES / name, [f"model.path='{tmp_path}'", "rollout.backend='vllm'"])


@pytest.mark.parametrize(("name", "shape"), [("gpu-1.5b.toml", "1.5b"), ("gpu-7b-lora.toml", "7b")])
def test_each_fits_one_h100_with_a_vllm_node(tmp_path, name, shape):
    cfg = _cfg(tmp_path, name, shape)
    from transformers import AutoConfig

    split = memory.shared_gpu(cfg, memory.shape_of(AutoConfig.from_pretrained(tmp_path)), 1, H100_GIB)
    mode = split.pick(cfg.run.mode)
    assert split.fits(mode), (name, split.async_gib, split.sync_gib)
    print(json.dumps({"example": name, "mode": mode, "async_gib": split.async_gib, "sync_gib": split.sync_gib}))


def test_the_examples_reward_resolves_and_scores_decodable_ids(tmp_path):
    cfg = _cfg(tmp_path, "gpu-1.5b.toml", "1.5b")
    assert cfg.data.path.startswith("lengths:") and cfg.rollout.max_tokens == 1024
    share = resolve(cfg.reward.functions[1], cfg.reward)
    # ids 1 and 2 are the tokenizer's (< 512), 600 and 152000 are not: 2 of 4; no tokens: 0.0
    assert share(completion_ids=[[1, 600, 2, 152000], [], [5]], completions=["", "", ""]) == [0.5, 0.0, 1.0]


def test_make_tiny_model_takes_the_real_vocabulary(tmp_path):
    from streamrl.ops.tiny_model import make

    make(tmp_path / "m", 0, "tiny:152k", "float32", "cpu")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["hidden_size"] == 64
    with pytest.raises(ValueError, match="with ':152k'"):
        make(tmp_path / "n", 0, "tiny:64k", "float32", "cpu")
