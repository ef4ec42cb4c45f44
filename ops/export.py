"""`streamrl export`: a checkpoint as an HF model folder that transformers and vLLM load without streamrl."""

from __future__ import annotations

import os
import pathlib

from streamrl.learner import checkpoint
from streamrl.learner.export import DEFAULT_SHARD_SIZE, ExportError, export_state


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
) -> pathlib.Path:
    """A checkpoint (a step folder, or a run / checkpoints folder: its newest) → an HF model folder at `out_dir`.

    Raises `checkpoint.CheckpointError` for a checkpoint that cannot be read, `ExportError` for a
    folder that cannot be written."""
    path = checkpoint.resolve(checkpoint_dir)
    hf_files = path / "hf"
    if not (hf_files / "config.json").is_file():
        raise ExportError(
            f"checkpoint {path} has no hf/config.json: it cannot be exported (was it copied without its hf/ folder?)"
        )
    return export_state(checkpoint.load_weights(path), hf_files, out_dir, max_shard_size, overwrite)
