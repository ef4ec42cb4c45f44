"""Fixtures of the GPU tests (each skips without a CUDA device)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory) -> str:
    """A small Qwen2 (head_dim 64: FlashAttention 3's sizes) in bf16 on the GPU, for vLLM there; skips without
    a CUDA device or vLLM."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from streamrl.engine.models import SHAPES, make_tiny_model

    folder = tmp_path_factory.mktemp("models") / "small"
    return str(make_tiny_model(folder, seed=3, dtype="bfloat16", device="cuda", **SHAPES["small"]))
