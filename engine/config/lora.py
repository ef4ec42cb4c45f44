"""The [lora] section: train low-rank adapters on a frozen base, push only the adapters (off by default)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from streamrl.engine.config.base import _doc, _Section

# The ranks vLLM 0.32 takes as max_lora_rank (vllm/config/lora.py: MaxLoRARanks); an adapter's rank may be
# any value up to the engine's slot rank, which is the smallest of these that holds it.
ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraConfig(_Section):
    """LoRA (Hu et al. 2021) through PEFT: W x + (alpha / rank) B A x on each target module, A and B trained
    in fp32, the base weights frozen in model.dtype. Each policy version is pushed as its adapter tensors
    alone and served as its own adapter (vLLM: one adapter name per version; hf: PEFT adapters)."""

    enabled: Annotated[bool, _doc("Train LoRA adapters instead of every weight; only the adapters are pushed.")] = False
    rank: Annotated[
        int, _doc("Adapter rank r (at most 512, vLLM's largest slot, and at most each target's smaller side).", ge=1)
    ] = 16
    alpha: Annotated[float, _doc("Scale numerator: updates are scaled by alpha / rank.", gt=0.0)] = 32.0
    dropout: Annotated[float, _doc("Dropout on the adapters' input while training.", ge=0.0, lt=1.0)] = 0.0
    target_modules: Annotated[
        list[str],
        _doc(
            "Module names (the last part, e.g. q_proj) that get adapters; 'all-linear': every linear layer of "
            "the decoder (not the LM head), as PEFT reads it."
        ),
    ] = msgspec.field(default_factory=lambda: ["all-linear"])

    def __post_init__(self) -> None:
        if self.rank > ENGINE_RANKS[-1]:
            raise ValueError(f"lora.rank = {self.rank} is above {ENGINE_RANKS[-1]}, the largest rank vLLM serves")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the modules to adapt, or ['all-linear']")
