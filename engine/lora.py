"""LoRA as every role sees it: which modules get adapters, the adapter's shape on the wire, its tensor names.

The learner trains adapters with PEFT (learner/lora.py); a push carries only the A and B tensors, under the
names PEFT saves them with (`base_model.model.<module>.lora_A.weight`), which vLLM's `LoRAModel` and PEFT's
`set_peft_model_state_dict` both read. Preflight and the learner judge a [lora] section against the model
here, from its config alone (a model built on the meta device: no weights are read).
"""

from __future__ import annotations

from typing import Any

from streamrl.engine.config.base import ConfigError
from streamrl.engine.config.lora import ENGINE_RANKS, LoraConfig
from streamrl.engine.messages import AdapterSpec

PEFT_PREFIX = "base_model.model."
ADAPTER = "default"  # PEFT's adapter name on the learner and on hf nodes
# never adapted: 'all-linear' leaves the output layer alone, as PEFT does; a value model's head (the LoRA critic's,
# learner/critic/model.adapt) is trained whole
SKIPPED = ("lm_head", "score")


class LoraError(ConfigError):
    """A [lora] section the model or engine cannot take; the message names the field."""


def linear_modules(model) -> dict[str, tuple[int, int]]:
    """Last name part -> (in_features, out_features) of the smallest such linear layer in the decoder."""
    from torch import nn

    found: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf not in SKIPPED:
            shape = (module.in_features, module.out_features)
            found[leaf] = min(found.get(leaf, shape), shape, key=min)
    return found


def meta_model(hf_config):
    """The model's module tree on the meta device (seconds for a 7B shape: no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def resolve(cfg: LoraConfig, modules: dict[str, tuple[int, int]]) -> AdapterSpec:
    """The adapter's spec for a model with these linear `modules`; LoraError naming the field otherwise."""
    wanted = sorted(modules) if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    unknown = [m for m in wanted if m not in modules]
    if unknown or not wanted:
        raise LoraError(
            f"lora.target_modules = {cfg.target_modules}: the model has no linear module named {unknown}; "
            f"it has {sorted(modules)} (or use ['all-linear'])"
        )
    smallest = min(min(modules[m]) for m in wanted)
    if cfg.rank > smallest:
        raise LoraError(
            f"lora.rank = {cfg.rank} does not fit: the smallest target side is {smallest} "
            f"({[m for m in wanted if min(modules[m]) == smallest][0]}); use a rank <= {smallest}"
        )
    return AdapterSpec(rank=cfg.rank, alpha=cfg.alpha, target_modules=wanted)


def spec_for(cfg: LoraConfig, hf_config) -> AdapterSpec:
    return resolve(cfg, linear_modules(meta_model(hf_config)))


def engine_rank(rank: int) -> int:
    """vLLM's slot rank for an adapter of `rank`: the smallest max_lora_rank it accepts that holds it."""
    return next(r for r in ENGINE_RANKS if r >= rank)


def peft_config(spec: AdapterSpec) -> dict[str, Any]:
    """adapter_config.json for this adapter (what PEFT and vLLM read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def wire_name(param_name: str) -> str:
    """A trained adapter parameter's name as PEFT saves it: `model.layers.0.self_attn.q_proj.lora_A.default.weight`
    (the model's own name, PEFT layers injected) -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return PEFT_PREFIX + param_name.removeprefix(PEFT_PREFIX).replace(f".{ADAPTER}.", ".")


def param_name(wire: str) -> str:
    """The inverse of `wire_name`: where the tensor lives in a model with PEFT's adapter `default` injected."""
    name = wire.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
    return name


def is_adapter(param_name: str) -> bool:
    return ".lora_A." in param_name or ".lora_B." in param_name


def reference_is_base(cfg) -> bool:
    """Whether a LoRA run's KL reference is its policy's own frozen base with the adapters off, not a model of
    its own: the reference is the starting weights (`loss.reference_path` empty: `model.path`), which LoRA
    never moves. verl's `ref_in_actor`, TRL's `disable_adapter()`. learner/reference.py builds by this, and
    preflight's memory estimate counts by it."""
    return cfg.lora.enabled and not cfg.loss.reference_path
