"""Writing and reading checkpoint folders (the layout is in `layout.py`): every rank takes part in
a save and a load; rank 0 writes the files that are not sharded."""

from __future__ import annotations

import errno
import os
import pathlib
import pickle
import random
import shutil
import time

import msgspec
import torch
from torch import nn

from streamrl.engine.messages import AdapterSpec
from streamrl.learner import parallel
from streamrl.learner.checkpoint import critic as critic_part
from streamrl.learner.checkpoint.layout import (
    FORMAT,
    META,
    CheckpointError,
    DiskFullError,
    LearnerState,
    Meta,
    check_compatible,
    check_writable,
    estimate_bytes,
    fingerprint,
    list_checkpoints,
    param_shapes,
    read_meta,
    resolve,
    side_files,
    state_dict_options,
    step_dir,
    trained_names,
)

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
    adapter: AdapterSpec | None = None,
    need: int = 0,
    critic=None,
) -> pathlib.Path:
    """Every rank calls: write `root/step_{state.step}` (model, optimizer, schedule, RNG, state), then
    apply the retention policy. Returns the checkpoint folder. LoRA (`adapter`): the trained adapters and
    their optimizer state alone; the frozen base is `model_source`'s. `need`: the bytes it takes
    (`estimate_bytes`, computed when 0). A checkpoint that does not fit raises `DiskFullError` on every rank
    and leaves nothing behind. `critic`: the trainer's critic, whose value model and optimizer go in too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = pathlib.Path(root)
    final, tmp = step_dir(root, state.step), root / f".tmp-step_{state.step}"
    # first: FSDP2's hook shows the sharded fp32 parameters
    model_sd, optim_sd = _trained(lm, *get_state_dict(lm, optimizer, options=state_dict_options(lm)))
    need = need or estimate_bytes(lm, model_source, parallel.world_size())
    _on_rank0_then_share(lambda: _prepare(root, tmp, need))
    try:
        dcp.save({"model": model_sd, "optim": optim_sd, **critic_part.state(critic)}, checkpoint_id=str(tmp))
    except BaseException as e:  # DCP reports a rank's failed write on every rank: CheckpointException, a BaseException
        if not _no_space(e):
            raise
        _on_rank0_then_share(lambda: _discard(tmp))
    rngs = parallel.gather_objects(_rng_state())
    # rank 0's files; its error reaches every rank (one rank raising alone would leave the others waiting)
    critic_meta = critic_part.meta(critic)
    _on_rank0_then_share(
        lambda: _finish(root, tmp, final, lm, scheduler, state, model_source, adapter, rngs, critic_meta)
    )
    if parallel.is_rank0():
        prune(root, keep_last, keep_every)
    return final


def _finish(root, tmp, final, lm, scheduler, state, model_source, adapter, rngs, critic_meta=None) -> None:
    """Rank 0: the files that are not sharded, meta.json last, then the folder under its name."""
    try:
        torch.save({"scheduler": scheduler.state_dict(), "rng": rngs}, tmp / "extra.pt")
        write_hf_files(lm, model_source, tmp / "hf")
        shapes, dtypes = param_shapes(lm)
        meta = Meta(
            FORMAT,
            msgspec.structs.replace(state, world_size=parallel.world_size(), time=time.time()),
            fingerprint(lm),
            shapes,
            dtypes,
            adapter=adapter,
            base=local_path(model_source) if adapter is not None else "",
            **(critic_meta or {}),  # checkpoint/critic.meta
        )
        _write_atomic(tmp / META, msgspec.json.encode(meta))
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        if not _no_space(e):
            raise
        _discard(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)


def _no_space(error: BaseException) -> bool:
    """The error, or one it wraps (DCP's CheckpointException keeps each rank's), is a full disk (ENOSPC)."""
    todo, looked = [error], set()
    while todo:
        seen = todo.pop()
        if id(seen) in looked:
            continue
        looked.add(id(seen))
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        todo += [e for e in (seen.__cause__, seen.__context__) if e is not None]
        todo += [failure for failure, _ in getattr(seen, "failures", {}).values()]
    return f"[Errno {errno.ENOSPC}]" in str(error)  # torch.save's RuntimeError names it only in its text


def _discard(tmp: pathlib.Path) -> None:
    """A checkpoint that did not fit: what was written of it goes (the room it took is the run's again)."""
    shutil.rmtree(tmp, ignore_errors=True)
    raise DiskFullError(f"the disk filled up while writing checkpoint {tmp.name.removeprefix('.tmp-')} in "
                        f"{tmp.parent} ({shutil.disk_usage(tmp.parent).free / 2**20:.1f} MiB free now); free space "
                        "or lower checkpoint.keep_last")  # fmt: skip


def _prepare(root: pathlib.Path, tmp: pathlib.Path, need: int) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a learner killed mid-save: its room counts
    check_writable(root, need)


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
        for file in side_files(source):
            shutil.copy2(file, out / file.name)
    elif model_source:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model_source).save_pretrained(out)
    lm.config.save_pretrained(out)
    if getattr(lm, "generation_config", None) is not None:
        lm.generation_config.save_pretrained(out)


# ---- load ------------------------------------------------------------------------------------


def load(path: str | os.PathLike, lm: nn.Module, optimizer, scheduler, critic=None) -> LearnerState:
    """Every rank calls: restore model, optimizer, schedule and RNG from `path` (any number of ranks
    may have saved it), and the critic's value model and optimizer when the run has one; returns the
    learner state to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = pathlib.Path(path)
    meta = read_meta(path)
    check_compatible(meta, lm, path)
    options = state_dict_options(lm)
    model_sd, optim_sd = _trained(lm, *get_state_dict(lm, optimizer, options=options))
    critic_sd = critic_part.state(critic)
    if critic_sd and not meta.critic:
        raise CheckpointError(
            f"checkpoint {path} has no critic, and this run trains one (loss.advantage = 'gae'); resume it with "
            "the loss it was saved with, or start a new run"
        )
    lora_now = getattr(critic, "adapter", None) is not None
    if critic_sd and lora_now != (meta.critic_adapter is not None):
        said = (
            ("a LoRA critic's adapters", "a full critic")
            if meta.critic_adapter is not None
            else ("a full critic", "a LoRA one")
        )
        raise CheckpointError(f"checkpoint {path} holds {said[0]}, and this run trains {said[1]}; resume it with "
                              f"critic.lora = {str(not lora_now).lower()}, as it was saved")  # fmt: skip
    dcp.load({"model": model_sd, "optim": optim_sd, **critic_sd}, checkpoint_id=str(path))
    set_state_dict(lm, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    critic_part.restore(critic, critic_sd)
    extra = _load_extra(path / "extra.pt")
    scheduler.load_state_dict(extra["scheduler"])
    rngs = extra["rng"]
    # Same world size: each rank its own stream. Resharded: every rank takes rank 0's, as at a fresh start.
    _set_rng_state(rngs[parallel.rank()] if len(rngs) == parallel.world_size() else rngs[0])
    return meta.state


def local_path(model: str) -> str:
    """`model` made absolute when it is a folder here (a relative base would name another folder wherever the
    checkpoint is exported or loaded from); a hub id or a missing path as given."""
    return str(pathlib.Path(model).resolve()) if model and pathlib.Path(model).exists() else model


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


# ---- ranks, RNG, files -----------------------------------------------------------------------


def _trained(lm: nn.Module, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
    """LoRA: a tied output layer is listed under its own name though frozen (it is not among the named
    parameters that ignore_frozen_params filters): only the trained parameters stay."""
    trained = trained_names(lm)
    return ({k: v for k, v in model_sd.items() if k in trained} if trained is not None else model_sd), optim_sd


def _on_rank0_then_share(fn) -> None:
    """Run `fn` on rank 0; every rank raises its error (so no rank waits in a collective for it), a full
    disk as `DiskFullError`."""
    error = None
    if parallel.is_rank0():
        try:
            fn()
        except CheckpointError as e:
            error = (isinstance(e, DiskFullError), str(e))
    error = parallel.from_rank0(error)
    if error:
        raise (DiskFullError if error[0] else CheckpointError)(error[1])


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
