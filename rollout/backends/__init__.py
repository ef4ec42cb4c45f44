"""The generation backend a config names, on the device it names."""

from __future__ import annotations

from streamrl.engine.config import Config
from streamrl.rollout.backends.protocol import GenerationBackend


def resolve_device(device: str) -> str:
    """`run.device` made concrete: auto picks cuda when present."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_backend(cfg: Config, device: str = "cpu") -> GenerationBackend:
    """The backend `cfg.rollout.backend` names, on the model `cfg.model` names (built-in tiny model when empty)."""
    from streamrl.engine.models import default_tiny_model

    model_path = cfg.model.path or str(default_tiny_model())
    if cfg.simulate.gen_s > 0:
        from streamrl.rollout.backends.sim import SimBackend

        return SimBackend(cfg, device)
    if cfg.rollout.backend == "vllm":
        from streamrl.rollout.backends.vllm import VLLMBackend, sleeps
        from streamrl.rollout.backends.vllm_support import lora_slots, sizing

        return VLLMBackend(
            model_path,
            cfg.model,
            cfg.rollout,
            seed=cfg.run.seed,
            device=device,
            lora=cfg.lora,
            lora_slots=lora_slots(cfg),
            size=sizing(cfg, device, model_path),
            sleep=sleeps(cfg),
        )
    from streamrl.rollout.backends.hf import HFBackend

    return HFBackend(
        model_path,
        cfg.model,
        cfg.rollout,
        seed=cfg.run.seed,
        device=device,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        lora=cfg.lora,
    )
