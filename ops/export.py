"""`streamrl export`: a checkpoint as an HF model folder that transformers and vLLM load without streamrl."""

from __future__ import annotations

import os
import pathlib
import tempfile

from streamrl.learner import checkpoint
from streamrl.learner.checkpoint import critic as critic_part
from streamrl.learner.export import DEFAULT_SHARD_SIZE, ExportError, export_adapter, export_state, merge_adapter


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    merge: bool = False,
    base: str = "",
    critic: bool = False,
) -> pathlib.Path:
    """A checkpoint (a step folder, or a run / checkpoints folder: its newest) → an HF model folder at `out_dir`;
    a LoRA checkpoint → a PEFT adapter folder, or with `merge` the base model (`base`, default the run's
    model.path) with the adapter merged in; with `critic`, the critic's value model (a one-label
    sequence-classification folder, as reward models are saved).

    Raises `checkpoint.CheckpointError` for a checkpoint that cannot be read, `ExportError` for a
    folder that cannot be written."""
    path = checkpoint.resolve(checkpoint_dir)
    hf_files = path / "hf"
    if not (hf_files / "config.json").is_file():
        raise ExportError(
            f"checkpoint {path} has no hf/config.json: it cannot be exported (was it copied without its hf/ folder?)"
        )
    meta = checkpoint.read_meta(path)
    if critic:
        if not meta.critic:
            raise ExportError(f"checkpoint {path} has no critic (its run's loss.advantage was not 'gae')")
        weights = critic_part.load_weights(path, meta.critic, meta.critic_dtypes)
        if meta.critic_adapter is not None:  # a LoRA critic: its adapters merged into its base, with its head
            weights = critic_part.merged(_critic_base(base or meta.critic_base), weights, meta.critic_adapter)
        return export_state(weights, hf_files, out_dir, max_shard_size, overwrite, value_model=True)
    if meta.adapter is None:
        return export_state(checkpoint.load_weights(path), hf_files, out_dir, max_shard_size, overwrite)
    base = checkpoint.local_path(base or meta.base)  # as PEFT's base_model_name_or_path: absolute
    if not merge:
        return export_adapter(checkpoint.load_weights(path), meta.adapter, base, hf_files, out_dir, overwrite)
    if not base or not pathlib.Path(base).exists():
        raise ExportError(f"--merge needs the base model the adapters were trained on: {base!r} is not there; "
                          "pass --base FOLDER")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        adapter = export_adapter(checkpoint.load_weights(path), meta.adapter, base, hf_files, pathlib.Path(tmp) / "a")
        return merge_adapter(adapter, base, out_dir, overwrite)


def _critic_base(base: str) -> dict:
    """A LoRA critic's frozen base as the value model loads it (HF names, its own dtype: the head at 0 where the
    folder has none); ExportError when the folder is not there."""
    import torch

    from streamrl.engine.config import ConfigError
    from streamrl.learner.critic.model import load_value_net

    if not base or not pathlib.Path(base).exists():
        raise ExportError(f"--critic of a LoRA critic needs the base its adapters were trained on: {base!r} is not "
                          "there; pass --base FOLDER")  # fmt: skip
    try:
        net = load_value_net(base)
    except ConfigError as e:
        raise ExportError(str(e)) from None
    return {name: value.to(torch.float32) for name, value in net.state_dict().items()}
