"""The critic's part of a checkpoint: its value model and optimizer, in the same DCP folder as the actor's.

One checkpoint, resharded on load like the actor's (DCP): the value model's sharded fp32 weights under the
key `critic` and its AdamW state under `critic_optim`, beside `model` and `optim`; meta.json lists the
critic's parameters (`Meta.critic`, HF names of the one-label sequence-classification model) so that
`streamrl export --critic` can read them in one process. `critic` is the trainer's `Shaper` (learner/critic/
trainer.py): anything with `.model` (the sharded `ValueModel`, or None without a critic) and `.optimizer`.

A LoRA critic (critic.lora) is saved as the actor's LoRA is: its adapters and head alone (its frozen base is the
folder it was loaded from, `Meta.critic_base`, kept as it was), with the adapter's spec (`Meta.critic_adapter`);
`streamrl export --critic` merges them into that base (`merged`).
"""

from __future__ import annotations

import pathlib

import torch

from streamrl.learner.checkpoint.layout import state_dict_options

KEYS = ("critic", "critic_optim")


def _model(critic):
    return getattr(critic, "model", None) if critic is not None else None


def _hf(name: str) -> str:
    """A value-model state-dict key as the HF folder names it (`net.model.layers.0...` -> `model.layers.0...`)."""
    from streamrl.learner.parallel import hf_name

    return hf_name(name).removeprefix("net.")


def state(critic) -> dict[str, dict]:
    """Every rank: the critic's sharded state dicts for `dcp.save` / `dcp.load` ({} without a critic)."""
    model = _model(critic)
    if model is None:
        return {}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(model, critic.optimizer, options=state_dict_options(model))
    return {"critic": weights, "critic_optim": optim}


def restore(critic, loaded: dict[str, dict]) -> None:
    """Every rank: put what `dcp.load` filled into `state(critic)`'s dicts back into the critic."""
    if not loaded:
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model = _model(critic)
    set_state_dict(model, critic.optimizer, model_state_dict=loaded["critic"],
                   optim_state_dict=loaded["critic_optim"], options=state_dict_options(model))  # fmt: skip


def meta(critic) -> dict:
    """The critic's fields of meta.json (layout.Meta): its saved parameters, DCP key -> full shape and -> dtype,
    and a LoRA critic's adapter spec and base folder ({} without a critic)."""
    model = _model(critic)
    if model is None:
        return {}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from streamrl.learner.checkpoint.store import local_path

    sd = get_model_state_dict(model, options=state_dict_options(model))  # a DTensor reports its full shape
    adapter = getattr(critic, "adapter", None)
    return {
        "critic": {k: list(v.shape) for k, v in sd.items()},
        "critic_dtypes": {k: str(v.dtype).removeprefix("torch.") for k, v in sd.items()},
        "critic_adapter": adapter,
        "critic_base": local_path(critic.base) if adapter is not None else "",
    }


def load_weights(path: pathlib.Path, params: dict[str, list[int]], dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """The critic's full weights under HF names, read in this one process (`streamrl export --critic`)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    weights = {name: torch.empty(shape, dtype=getattr(torch, dtypes[name])) for name, shape in params.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"critic": weights}, checkpoint_id=str(path), no_dist=True)
    return {_hf(name): value for name, value in weights.items()}


def merged(base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], spec) -> dict[str, torch.Tensor]:
    """A LoRA critic as a plain value model: its base's weights (HF names) with each adapted linear's W + alpha / r
    * B A, and the trained head. `trained` as `load_weights` reads them (PEFT's names: `...q_proj.lora_A.default
    .weight`)."""
    out = dict(base)
    scale = spec.alpha / spec.rank
    for name, a in trained.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        b = trained[name.replace(".lora_A.", ".lora_B.")]
        weight = out[f"{module}.weight"]
        out[f"{module}.weight"] = (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
    out.update({name: value for name, value in trained.items() if not (".lora_A." in name or ".lora_B." in name)})
    return out
