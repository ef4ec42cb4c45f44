"""HF export: a folder that `AutoModelForCausalLM.from_pretrained` and vLLM load with no streamrl.

Sharded safetensors (with their index when there is more than one shard), `config.json`,
`generation_config.json` and the tokenizer files. Written from a full state dict: rank 0's during
training, or one read from a checkpoint folder by `streamrl export` (ops/export.py).
The folder appears under its final name only when complete.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from collections.abc import Mapping

import torch
from torch import Tensor

DEFAULT_SHARD_SIZE = "2GB"


class ExportError(RuntimeError):
    """An export that cannot be written; the message names the folder and the fix."""


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
        raise ExportError(
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


def _check_out(out: pathlib.Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"export folder {out} exists and is not empty; choose another folder or pass --overwrite")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create the export folder's parent {parent} ({e.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise ExportError(f"export folder {parent} is not writable; choose another OUT")


def _tied(config, key: str) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False)) and key == "lm_head.weight"


def _dtype_of(state: Mapping[str, Tensor]) -> torch.dtype:
    return next(iter(state.values())).dtype if state else torch.float32
