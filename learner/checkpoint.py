"""One resumable checkpoint per step: `RUN/checkpoints/step_N/`, written by every rank together.

Layout of a checkpoint folder:
  *.distcp, .metadata   model + optimizer, sharded by torch.distributed.checkpoint (DCP); each rank
                        writes only its own shards, and a load reshards to any number of ranks
  extra.pt              LR schedule and every rank's RNG states (rank 0 writes it)
  meta.json             learner state (step, policy version, ledger position), the model's
                        fingerprint and parameter shapes; written last, so its presence marks a
                        complete checkpoint
  hf/                   config, generation config and tokenizer files: what an HF export needs
                        besides the weights (`learner/export.py`)

The folder is written under a temporary name and renamed when complete, so a learner killed
mid-save leaves no half checkpoint that `latest` could pick.
"""

from __future__ import annotations

import logging
import os
import pathlib
import pickle
import random
import re
import shutil
import time

import msgspec
import torch
from torch import nn

from streamrl.engine.config import CheckpointConfig
from streamrl.learner import parallel
from streamrl.learner.export import export_state

FORMAT = 1
META = "meta.json"
_STEP = re.compile(r"^step_(\d+)$")
_FINGERPRINT_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the folder and the fix."""


class LearnerState(msgspec.Struct):
    """Where the learner was: `step` optimizer steps run, `version` published to the ledger."""

    step: int
    version: int
    skipped_steps: int = 0
    ledger_version: int = 0  # the ledger's version when the checkpoint was taken
    world_size: int = 1
    time: float = 0.0


class Meta(msgspec.Struct):
    format: int
    state: LearnerState
    model: dict[str, object]  # architecture fingerprint: a resumed model must match every field
    params: dict[str, list[int]]  # HF parameter name -> full shape
    dtypes: dict[str, str]  # HF parameter name -> torch dtype name


def fingerprint(lm: nn.Module) -> dict[str, object]:
    """The architecture fields a checkpoint must share with the model it is loaded into."""
    config = lm.config.to_dict()
    return {k: config.get(k) for k in _FINGERPRINT_FIELDS if k in config}


def param_shapes(lm: nn.Module) -> tuple[dict[str, list[int]], dict[str, str]]:
    shapes, dtypes = {}, {}
    for name, value in lm.state_dict().items():
        shapes[name] = list(value.shape)  # a DTensor reports its full shape
        dtypes[name] = str(value.dtype).removeprefix("torch.")
    return shapes, dtypes


# ---- where checkpoints live ------------------------------------------------------------------


def checkpoints_dir(run_dir: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(run_dir) / "checkpoints"


def step_dir(root: pathlib.Path, step: int) -> pathlib.Path:
    return root / f"step_{step}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, pathlib.Path]]:
    """Complete checkpoints (meta.json present) under `root`, oldest first."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP.match(child.name)
        if m and (child / META).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def resolve(spec: str | os.PathLike, run_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """A checkpoint folder from `latest` (in the run folder), a step folder, a checkpoints folder or
    a run folder (both: their newest checkpoint)."""
    if str(spec) == "latest":
        if run_dir is None:
            raise CheckpointError("'latest' needs the run folder (run.dir / run.name); or give a checkpoint path")
        spec = checkpoints_dir(run_dir)
    path = pathlib.Path(spec)
    if (path / META).is_file():
        return path
    for root in (path, checkpoints_dir(path)):
        found = list_checkpoints(root)
        if found:
            return found[-1][1]
    raise CheckpointError(
        f"no complete checkpoint at {path} (a step_N folder with {META}, or a folder holding "
        "them); check the path, or start without --resume"
    )


def read_meta(path: str | os.PathLike) -> Meta:
    file = pathlib.Path(path) / META
    try:
        return msgspec.json.decode(file.read_bytes(), type=Meta)
    except (OSError, msgspec.DecodeError) as e:
        raise CheckpointError(f"{file}: not a readable streamrl checkpoint ({e})") from None


def check_compatible(meta: Meta, lm: nn.Module, path: pathlib.Path) -> None:
    """Refuse a checkpoint of another architecture, naming the first field that differs."""
    if meta.format != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.format}; this streamrl reads format {FORMAT}")
    mine = fingerprint(lm)
    for key in sorted(set(meta.model) | set(mine)):
        if meta.model.get(key) != mine.get(key):
            raise CheckpointError(
                f"checkpoint {path} is from another model: {key} = {meta.model.get(key)!r} there, "
                f"{mine.get(key)!r} in this run's model (model.path); resume with the model "
                "it was trained from, or start a new run"
            )
    shapes, _ = param_shapes(lm)
    for name in sorted(set(meta.params) | set(shapes)):
        if meta.params.get(name) != shapes.get(name):
            raise CheckpointError(
                f"checkpoint {path} is from another model: parameter {name} has shape "
                f"{meta.params.get(name)} there, {shapes.get(name)} in this run's model"
            )


def check_writable(root: pathlib.Path, need_bytes: int) -> None:
    """Fail early: the folder can be created and written, and the disk has room for a checkpoint."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"checkpoint folder {root} is not writable ({e.strerror}); set run.dir to a writable folder"
        ) from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise CheckpointError(
            f"not enough disk for a checkpoint in {root}: about {need_bytes / 2**20:.1f} MiB "
            f"needed, {free / 2**20:.1f} MiB free; free space, lower checkpoint.keep_last, "
            "or point run.dir elsewhere"
        )


def estimate_bytes(lm: nn.Module) -> int:
    """Weights plus AdamW's two moments, with 10% and 16 MiB to spare."""
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    return int(weights * 3 * 1.1) + (16 << 20)


# ---- save ------------------------------------------------------------------------------------


def save(
    root: str | os.PathLike,
    lm: nn.Module,
    optimizer,
    scheduler,
    state: LearnerState,
    model_source: str = "",
    keep_last: int = 2,
    keep_every: int = 0,
) -> pathlib.Path:
    """Every rank calls: write `root/step_{state.step}` (model, optimizer, schedule, RNG, state), then
    apply the retention policy. Returns the checkpoint folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = pathlib.Path(root)
    final, tmp = step_dir(root, state.step), root / f".tmp-step_{state.step}"
    model_sd, optim_sd = get_state_dict(lm, optimizer)  # first: FSDP2's hook shows the sharded fp32 parameters
    _on_rank0_then_share(lambda: _prepare(root, tmp, estimate_bytes(lm)))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    rngs = parallel.gather_objects(_rng_state())
    if parallel.is_rank0():
        torch.save({"scheduler": scheduler.state_dict(), "rng": rngs}, tmp / "extra.pt")
        write_hf_files(lm, model_source, tmp / "hf")
        shapes, dtypes = param_shapes(lm)
        meta = Meta(
            FORMAT,
            msgspec.structs.replace(state, world_size=parallel.world_size(), time=time.time()),
            fingerprint(lm),
            shapes,
            dtypes,
        )
        _write_atomic(tmp / META, msgspec.json.encode(meta))
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        prune(root, keep_last, keep_every)
    parallel.barrier()
    return final


def _prepare(root: pathlib.Path, tmp: pathlib.Path, need: int) -> None:
    check_writable(root, need)
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a learner killed mid-save


def prune(root: pathlib.Path, keep_last: int, keep_every: int = 0) -> list[pathlib.Path]:
    """Delete checkpoints outside the policy (the newest `keep_last`, plus every step that is a
    multiple of `keep_every`); return the deleted folders."""
    found = list_checkpoints(root)
    keep = {step for step, _ in found[-keep_last:]} if keep_last > 0 else set()
    if keep_every > 0:
        keep |= {step for step, _ in found if step % keep_every == 0}
    gone = [path for step, path in found if step not in keep]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def write_hf_files(lm: nn.Module, model_source: str, out: pathlib.Path) -> None:
    """Config, generation config and tokenizer files beside the weights: an export needs them."""
    out.mkdir(parents=True, exist_ok=True)
    source = pathlib.Path(model_source) if model_source else None
    if source is not None and source.is_dir():
        for file in source.iterdir():
            if file.is_file() and not file.name.endswith(_WEIGHT_SUFFIXES) and file.name not in _INDEX_FILES:
                shutil.copy2(file, out / file.name)
    elif model_source:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model_source).save_pretrained(out)
    lm.config.save_pretrained(out)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(out)


# ---- load ------------------------------------------------------------------------------------


def load(path: str | os.PathLike, lm: nn.Module, optimizer, scheduler) -> LearnerState:
    """Every rank calls: restore model, optimizer, schedule and RNG from `path` (any number of ranks
    may have saved it); returns the learner state to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = pathlib.Path(path)
    meta = read_meta(path)
    check_compatible(meta, lm, path)
    model_sd, optim_sd = get_state_dict(lm, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    set_state_dict(lm, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    extra = _load_extra(path / "extra.pt")
    scheduler.load_state_dict(extra["scheduler"])
    rngs = extra["rng"]
    # Same world size: each rank its own stream. Resharded: every rank takes rank 0's, as at a fresh start.
    _set_rng_state(rngs[parallel.rank()] if len(rngs) == parallel.world_size() else rngs[0])
    return meta.state


def load_weights(spec: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's full weights from a checkpoint (`spec` as for `resolve`), read in this one process
    whatever world size saved it; no process group needed."""
    import warnings

    import torch.distributed.checkpoint as dcp

    path = resolve(spec)
    meta = read_meta(path)
    state = {name: torch.empty(shape, dtype=getattr(torch, meta.dtypes[name])) for name, shape in meta.params.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({"model": state}, checkpoint_id=str(path), no_dist=True)
    return state


# ---- the learner loop's handle ---------------------------------------------------------------


class Keeper:
    """When the learner saves, exports and resumes (`checkpoint.every`, `export_every`, `--resume`).

    Built before training: an unwritable folder or a full disk fails the run at start, not at the
    first save an hour in. `trainer` needs `.optimizer`, `.scheduler`, `.version`, `.skipped_steps`.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | os.PathLike,
        lm: nn.Module,
        trainer,
        model_source: str,
        last_step: int,
    ):
        self.cfg, self.lm, self.trainer, self.model_source = cfg, lm, trainer, model_source
        self.root, self.exports = checkpoints_dir(run_dir), pathlib.Path(run_dir) / "exports"
        self.last_step = last_step
        if cfg.every:
            _on_rank0_then_share(lambda: check_writable(self.root, estimate_bytes(lm)))
        if cfg.export_every:
            _on_rank0_then_share(lambda: check_writable(self.exports, estimate_bytes(lm) // 3))
            if parallel.is_rank0():
                write_hf_files(lm, model_source, self.exports / ".hf")

    def resume(self, spec: str, run_dir: str | os.PathLike) -> LearnerState:
        """Every rank: load the checkpoint `spec` names (`latest`, or a path) into the model and trainer."""
        path = resolve(spec, run_dir)
        state = load(path, self.lm, self.trainer.optimizer, self.trainer.scheduler)
        self.trainer.version, self.trainer.skipped_steps = state.version, state.skipped_steps
        if parallel.is_rank0():
            logging.getLogger("streamrl.learner").info(
                "resumed from %s: step %d, version %d, saved by %d ranks, loaded on %d",
                path,
                state.step,
                state.version,
                state.world_size,
                parallel.world_size(),
            )
        return state

    def after_step(self, step: int, policy: nn.Module) -> None:
        """Every rank: save and export when due (and at the last step). The host copy of the weights an
        export needs is made only then (`parallel.full_state_dict`, every rank takes part)."""
        due = lambda every: every and (step % every == 0 or step == self.last_step)  # noqa: E731
        if due(self.cfg.every):
            state = LearnerState(
                step=step,
                version=self.trainer.version,
                skipped_steps=self.trainer.skipped_steps,
                ledger_version=self.trainer.version,
            )
            save(
                self.root,
                self.lm,
                self.trainer.optimizer,
                self.trainer.scheduler,
                state,
                self.model_source,
                self.cfg.keep_last,
                self.cfg.keep_every,
            )
        if due(self.cfg.export_every):
            full_state = parallel.full_state_dict(policy)
            if parallel.is_rank0():
                export_state(full_state, self.exports / ".hf", self.exports / f"step_{step}", overwrite=True)


# ---- ranks, RNG, files -----------------------------------------------------------------------


def _on_rank0_then_share(fn) -> None:
    """Run `fn` on rank 0; every rank raises its error (so no rank waits in a collective for it)."""
    error = None
    if parallel.is_rank0():
        try:
            fn()
        except CheckpointError as e:
            error = str(e)
    error = parallel.from_rank0(error)
    if error:
        raise CheckpointError(error)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        # the key array as a tensor: `torch.load(weights_only=True)` refuses numpy objects
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def _load_extra(path: pathlib.Path) -> dict:
    """extra.pt with torch's safe loader (tensors and plain containers only): a file that holds anything
    else, such as a pickled callable put there to run code on resume, is refused."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message says to reload with weights_only=False: not advice to pass on. Its line naming
        # the refused object is what helps.
        named = [line for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        refused = (named or ["?"])[0].strip()
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain values ({refused}); it was not written by "
            "streamrl or was altered, so it is not loaded (loading it could run code). Resume from another "
            "checkpoint, or start the run afresh"
        ) from None


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
