"""Checkpoints: what a folder holds and where it lives (`layout.py`), writing and reading one with
every rank (`store.py`), and the learner loop's handle that decides when (`keeper.py`)."""

from streamrl.learner.checkpoint.keeper import Keeper
from streamrl.learner.checkpoint.layout import (
    FORMAT,
    META,
    CheckpointError,
    LearnerState,
    Meta,
    check_compatible,
    check_writable,
    checkpoints_dir,
    estimate_bytes,
    fingerprint,
    list_checkpoints,
    param_shapes,
    read_meta,
    resolve,
    step_dir,
)
from streamrl.learner.checkpoint.store import load, load_weights, prune, save, write_hf_files

__all__ = [
    "FORMAT",
    "META",
    "CheckpointError",
    "Keeper",
    "LearnerState",
    "Meta",
    "check_compatible",
    "check_writable",
    "checkpoints_dir",
    "estimate_bytes",
    "fingerprint",
    "list_checkpoints",
    "load",
    "load_weights",
    "param_shapes",
    "prune",
    "read_meta",
    "resolve",
    "save",
    "step_dir",
    "write_hf_files",
]
