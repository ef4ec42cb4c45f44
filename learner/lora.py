"""The learner's LoRA: PEFT adapters injected into the HF model before FSDP2 wraps it.

The base weights stay frozen in the compute dtype (model.dtype: bf16 on a GPU halves their memory, and
nothing reduces their gradients); the adapters are fp32 master weights, cast to the compute dtype by
FSDP2's mixed precision like full training's. FSDP2 needs one dtype among a unit's trainable parameters
only, so frozen bf16 and trainable fp32 share a unit. The model keeps its own module tree (PEFT's layers
in place of the target linears), so `PolicyModel`, compile and activation checkpointing see the same model.
"""

from __future__ import annotations

import torch
from torch import nn

from streamrl.engine import lora
from streamrl.engine.config import LoraConfig
from streamrl.engine.messages import AdapterSpec


def apply(
    model: nn.Module, cfg: LoraConfig, base_dtype: torch.dtype, task_type: str | None = "CAUSAL_LM"
) -> tuple[nn.Module, AdapterSpec]:
    """`model` with PEFT's LoRA layers injected (adapter `default`), only they trainable, and its spec.

    B starts at zero (PEFT's init), so version 0 of the adapted model is the base model exactly. task_type: PEFT's
    wrapper kind, of which only the injected HF model is kept (None for a model that is not a causal LM: the
    critic's classifier, whose head PEFT's SEQ_CLS would wrap and rename)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    spec = lora.resolve(cfg, lora.linear_modules(model))
    peft_cfg = PeftLoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(spec.target_modules),
        bias="none",
        task_type=task_type,
    )
    model = model.to(base_dtype)
    injected = get_peft_model(model, peft_cfg, adapter_name=lora.ADAPTER).base_model.model  # the HF model itself
    for name, param in injected.named_parameters():
        param.requires_grad_(lora.is_adapter(name))
        if param.requires_grad:
            param.data = param.data.float()
    return injected, spec


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' full tensors under their wire (PEFT saved) names, detached; every rank calls."""
    from torch.distributed.tensor import DTensor

    from streamrl.learner.parallel import hf_name

    out = {}
    for name, param in model.named_parameters():
        name = hf_name(name).removeprefix("lm.")
        if lora.is_adapter(name):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[lora.wire_name(name)] = full.detach()
    return out


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


class AdaptersOff:
    """A context manager: inside it `model` (its LoRA layers) runs as the frozen base alone, in eval mode
    (as a reference of its own runs); after it as before. The layers are found once, here: it is entered
    once per micro-batch.

    PEFT's own switch (`enable_adapters`, under `PeftModel.disable_adapter`) also writes the adapters'
    requires_grad, on whichever copy a layer holds at that moment (FSDP2's gathered one while the root unit
    stays gathered, else the shard the optimizer holds); here the layers' flag is set directly and
    requires_grad is never written. A compiled layer (`learner.compile`) guards on the flag and the mode: one
    more graph a layer, made once (as a reference of its own compiled its own)."""

    def __init__(self, model: nn.Module):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.modules = list(model.modules())
        self.layers = [m for m in self.modules if isinstance(m, BaseTunerLayer)]
        if not self.layers:
            raise ValueError("AdaptersOff: the model has no LoRA layers (learner/lora.apply injects them)")
        self._saved: list[tuple[list[bool], list[bool]]] = []

    def __enter__(self) -> None:
        self._saved.append(([m._disable_adapters for m in self.layers], [m.training for m in self.modules]))
        for m in self.layers:
            m._disable_adapters = True
        for m in self.modules:
            m.training = False

    def __exit__(self, *exc) -> None:
        flags, modes = self._saved.pop()
        for m, flag in zip(self.layers, flags):
            m._disable_adapters = flag
        for m, mode in zip(self.modules, modes):
            m.training = mode
