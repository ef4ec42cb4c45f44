"""The generation backend a config names, on the device it names."""

from __future__ import annotations

from streamrl.engine.config import Config
from streamrl.rollout.engine import GenerationEngine, check_sampling


def resolve_device(device: str) -> str:
    """`run.device` made concrete: auto picks cuda when present."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_engine(cfg: Config, device: str = "cpu") -> GenerationEngine:
    """The backend `cfg.rollout.backend` names, on the model `cfg.model` names (built-in tiny model when empty)."""
    from streamrl.engine.models import default_tiny_model

    model_path = cfg.model.path or str(default_tiny_model())
    check_sampling(cfg.rollout)
    if cfg.simulate.gen_s > 0:
        from streamrl.rollout.sim_engine import SimEngine

        return SimEngine(cfg, device)
    if cfg.rollout.backend == "vllm":
        from streamrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, cfg.model, cfg.rollout, seed=cfg.run.seed, device=device)
    from streamrl.rollout.hf_engine import HFEngine

    return HFEngine(
        model_path,
        cfg.model,
        cfg.rollout,
        seed=cfg.run.seed,
        device=device,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
    )
