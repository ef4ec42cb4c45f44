"""HF export: a folder that `AutoModelForCausalLM.from_pretrained` and vLLM load with no streamrl (the critic's
value model: one that `AutoModelForSequenceClassification.from_pretrained` loads, one label, as reward models are).

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
    value_model: bool = False,
) -> pathlib.Path:
    """Write `state` (HF names, full tensors) as an HF model folder, with the config and tokenizer
    files found in `hf_files` (a checkpoint's `hf/` or the source model's folder). value_model: `state` is the
    critic's (body and `score`), written as a one-label sequence-classification model of the same architecture."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    hf_files, out = pathlib.Path(hf_files), pathlib.Path(out_dir)
    _check_out(out, overwrite)
    config = AutoConfig.from_pretrained(hf_files, **({"num_labels": 1} if value_model else {}))
    if value_model and config.pad_token_id is None:
        config.pad_token_id = config.eos_token_id  # its forward finds each sequence's last token by the pad id
    kind = AutoModelForSequenceClassification if value_model else AutoModelForCausalLM
    with torch.device("meta"):
        model = kind.from_config(config, dtype=_dtype_of(state))
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


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def export_adapter(
    tensors: Mapping[str, Tensor],
    spec,
    base: str,
    hf_files: str | os.PathLike,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
) -> pathlib.Path:
    """LoRA: a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors` under PEFT's saved names,
    the tokenizer files) that `PeftModel.from_pretrained` and vLLM's `LoRARequest` load; `tensors` under the
    model's names (`...q_proj.lora_A.default.weight`) or PEFT's; `base` the model they adapt."""
    import json

    from safetensors.torch import save_file

    from streamrl.engine.lora import peft_config, wire_name

    out = pathlib.Path(out_dir)
    _check_out(out, overwrite)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file({wire_name(k): v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS))
    (tmp / "adapter_config.json").write_text(json.dumps({**peft_config(spec), "base_model_name_or_path": base}))
    for file in pathlib.Path(hf_files).iterdir():
        if file.is_file() and "token" in file.name:  # the tokenizer, for serving the adapter alone
            shutil.copy2(file, tmp / file.name)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def merge_adapter(adapter_dir: str | os.PathLike, base: str, out_dir: str | os.PathLike, overwrite: bool = False):
    """The base model with the adapter merged in (W + alpha / r * B A), as a plain HF model folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = pathlib.Path(out_dir)
    _check_out(out, overwrite)
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out
