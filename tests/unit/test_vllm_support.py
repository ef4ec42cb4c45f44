"""vLLM's serving rules, reproduced without vLLM: head sizes on CPU, the longest sequence; the node refuses early."""

from __future__ import annotations

import time

import pytest
from transformers import LlamaConfig, Qwen2Config

from streamrl.engine.config import ModelConfig, RolloutConfig
from streamrl.engine.models import ModelLoadError
from streamrl.rollout.backends.vllm_support import head_size, support_problems


def test_head_size_is_head_dim_else_hidden_over_heads():
    assert head_size(Qwen2Config(hidden_size=64, num_attention_heads=2, head_dim=48)) == 48
    assert head_size(LlamaConfig(hidden_size=64, num_attention_heads=4)) == 16  # 64 / 4
    assert head_size(LlamaConfig(hidden_size=96, num_attention_heads=2, head_dim=None)) == 48  # 96 / 2


def test_cpu_head_sizes_and_max_len():
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256)  # head 16
    (problem,) = support_problems(llama, max_model_len=256, device="cpu")
    assert problem.startswith("head_dim = 16, which vLLM's CPU attention cannot run")
    assert support_problems(llama, max_model_len=256, device="cuda") == []  # the rule is the CPU kernel's
    qwen = Qwen2Config(hidden_size=64, num_attention_heads=2, head_dim=48, max_position_embeddings=256)
    assert support_problems(qwen, max_model_len=256, device="cpu") == []
    (too_long,) = support_problems(qwen, max_model_len=512, device="cpu")
    assert too_long == (
        "model.max_model_len = 512 is more than the model's max_position_embeddings = 256, which vLLM refuses; "
        "set model.max_model_len <= 256"
    )
    scaled = Qwen2Config(
        head_dim=64, max_position_embeddings=256, rope_parameters={"rope_type": "linear", "factor": 4.0}
    )
    assert support_problems(scaled, max_model_len=512, device="cpu") == []  # RoPE scaling: vLLM's own sum, not ours


def test_the_vllm_node_refuses_the_model_before_starting_an_engine(llama_head_dim_16):
    from streamrl.rollout.backends.vllm import VLLMBackend

    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"vLLM cannot serve .*llama-hd16: head_dim = 16, which vLLM's CPU"):
        VLLMBackend(llama_head_dim_16, ModelConfig(path=llama_head_dim_16), RolloutConfig(), device="cpu")
    assert time.perf_counter() - start < 10.0
