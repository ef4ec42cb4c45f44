"""The critic's part of a checkpoint: its value model and optimizer, in the same DCP folder as the actor's.

One checkpoint, resharded on load like the actor's (DCP): the value model's sharded fp32 weights under the
key `critic` and its AdamW state under `critic_optim`, beside `model` and `optim`; meta.json lists the
critic's parameters (`Meta.critic`, HF names of the one-label sequence-classification model) so that
`streamrl export --critic` can read them in one process. `critic` is the trainer's `Shaper` (learner/critic/
trainer.py): anything with `.model` (the sharded `ValueModel`, or None without a critic) and `.optimizer`.
"""

from __future__ import annotations

import pathlib

import torch

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

    weights, optim = get_state_dict(model, critic.optimizer)
    return {"critic": weights, "critic_optim": optim}


def restore(critic, loaded: dict[str, dict]) -> None:
    """Every rank: put what `dcp.load` filled into `state(critic)`'s dicts back into the critic."""
    if not loaded:
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        _model(critic), critic.optimizer, model_state_dict=loaded["critic"], optim_state_dict=loaded["critic_optim"]
    )


def shapes(critic) -> tuple[dict[str, list[int]], dict[str, str]]:
    """The critic's parameters for meta.json: DCP key -> full shape, and -> dtype ({} without a critic)."""
    model = _model(critic)
    if model is None:
        return {}, {}
    sd = model.state_dict()
    return {k: list(v.shape) for k, v in sd.items()}, {k: str(v.dtype).removeprefix("torch.") for k, v in sd.items()}


def load_weights(path: pathlib.Path, params: dict[str, list[int]], dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """The critic's full weights under HF names, read in this one process (`streamrl export --critic`)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    weights = {name: torch.empty(shape, dtype=getattr(torch, dtypes[name])) for name, shape in params.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"critic": weights}, checkpoint_id=str(path), no_dist=True)
    return {_hf(name): value for name, value in weights.items()}
