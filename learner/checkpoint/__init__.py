"""Checkpoints: what a folder holds and where it lives (`layout.py`), writing and reading one with
every rank (`store.py`), and the learner loop's handle that decides when (`keeper.py`). What the
rest of streamrl uses is named here."""

from streamrl.learner.checkpoint.keeper import Keeper
from streamrl.learner.checkpoint.layout import (
    CheckpointError,
    DiskFullError,
    LearnerState,
    check_writable,
    checkpoints_dir,
    list_checkpoints,
    read_meta,
    resolve,
)
from streamrl.learner.checkpoint.store import load, load_weights, local_path, prune, save

__all__ = ["CheckpointError", "DiskFullError", "Keeper", "LearnerState", "check_writable", "checkpoints_dir",
           "list_checkpoints", "load", "load_weights", "local_path", "prune", "read_meta", "resolve",
           "save"]  # fmt: skip
