"""Shared fixtures. Each role's fixtures live in the section marked for it."""

from __future__ import annotations

import os

# Before any vLLM import: in-process engines (~2 s start instead of ~14 s) and no torch.compile
# on the first logprobs request (10-16 s). See FINDINGS.md.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """The built-in tiny Qwen2 (seed 0), written once per test session."""
    from streamrl.engine.models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0))


# ---- ledger / Redis fixtures (owned by the ledger work) ----
