"""HF export: a folder that `AutoModelForCausalLM.from_pretrained` and vLLM load with no streamrl.

Sharded safetensors (with their index when there is more than one shard), `config.json`,
`generation_config.json` and the tokenizer files. Written from a full state dict (rank 0's, during
training) or straight from a checkpoint folder (`export_checkpoint`, no learner, no process group).
The folder appears under its final name only when complete.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import warnings
from collections.abc import Mapping

import torch
from torch import Tensor

from streamrl.learner.checkpoint import CheckpointError, read_meta, resolve

DEFAULT_SHARD_SIZE = "2GB"


def export_state(
    state: Mapping[str, Tensor],
    hf_files: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
) -> pathlib.Path:
    """Write `state` (HF names, full tensors) as an HF model folder, with the config and tokenizer
    files found in `hf_files` (a checkpoint's `hf/` or the source model's folder)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_files, out = pathlib.Path(hf_files), pathlib.Path(out_dir)
    _check_out(out, overwrite)
    config = AutoConfig.from_pretrained(hf_files)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_dtype_of(state))
    missing, unexpected = model.load_state_dict(dict(state), strict=False, assign=True)
    missing = [k for k in missing if not _tied(config, k)]
    if missing or unexpected:
        raise CheckpointError(
            f"the weights do not fit the model in {hf_files / 'config.json'}: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, max_shard_size=max_shard_size, safe_serialization=True)
    for file in hf_files.iterdir():
        if file.is_file() and not (tmp / file.name).exists():
            shutil.copy2(file, tmp / file.name)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def load_checkpoint_weights(checkpoint: str | os.PathLike) -> dict[str, Tensor]:
    """The model's full weights from a DCP checkpoint, read in this one process (any saving world size)."""
    import torch.distributed.checkpoint as dcp

    path = resolve(checkpoint)
    meta = read_meta(path)
    state = {name: torch.empty(shape, dtype=getattr(torch, meta.dtypes[name])) for name, shape in meta.params.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    return state


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
) -> pathlib.Path:
    """`streamrl export`: a checkpoint (a step folder, or a run / checkpoints folder: its newest)
    → an HF model folder at `out_dir`."""
    path = resolve(checkpoint_dir)
    hf_files = path / "hf"
    if not (hf_files / "config.json").is_file():
        raise CheckpointError(
            f"checkpoint {path} has no hf/config.json: it cannot be exported (was it copied without its hf/ folder?)"
        )
    return export_state(load_checkpoint_weights(path), hf_files, out_dir, max_shard_size, overwrite)


def _check_out(out: pathlib.Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"export folder {out} exists and is not empty; choose another folder or pass --overwrite")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the export folder's parent {parent} ({e.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"export folder {parent} is not writable; choose another OUT")


def _tied(config, key: str) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False)) and key == "lm_head.weight"


def _dtype_of(state: Mapping[str, Tensor]) -> torch.dtype:
    return next(iter(state.values())).dtype if state else torch.float32
