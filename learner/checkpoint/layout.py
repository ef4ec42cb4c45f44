"""What a checkpoint folder holds and where it lives: one resumable checkpoint per step,
`RUN/checkpoints/step_N/`, written by every rank together.

Layout of a checkpoint folder:
  *.distcp, .metadata   model + optimizer, sharded by torch.distributed.checkpoint (DCP); each rank
                        writes only its own shards, and a load reshards to any number of ranks
  extra.pt              LR schedule and every rank's RNG states (rank 0 writes it)
  meta.json             learner state (step, policy version, skipped steps), the model's
                        fingerprint and parameter shapes; written last, so its presence marks a
                        complete checkpoint
  hf/                   config, generation config and tokenizer files: what an HF export needs
                        besides the weights (`learner/export.py`)

The folder is written under a temporary name and renamed when complete, so a learner killed
mid-save leaves no half checkpoint that `latest` could pick.
"""

from __future__ import annotations

import errno
import os
import pathlib
import re
import shutil

import msgspec
from torch import nn

from streamrl.engine.messages import AdapterSpec

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


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the folder and the fix."""


class LearnerState(msgspec.Struct):
    """Where the learner was: `step` optimizer steps run, `version` published to the ledger."""

    step: int
    version: int
    skipped_steps: int = 0
    world_size: int = 1
    time: float = 0.0
    critic_steps: int = 0  # steps the critic trained (its warm-up counts them)
    kl_coef: float | None = None  # the adaptive KL controller's beta (learner/critic/kl_control.py); None: fixed

    def trainer_state(self) -> dict[str, int | float | None]:
        """What `Trainer.load_state_dict` takes back (`Trainer.state_dict` wrote it)."""
        return {
            "version": self.version,
            "skipped_steps": self.skipped_steps,
            "critic_steps": self.critic_steps,
            "kl_coef": self.kl_coef,
        }


class Meta(msgspec.Struct):
    format: int
    state: LearnerState
    model: dict[str, object]  # architecture fingerprint: a resumed model must match every field
    params: dict[str, list[int]]  # HF parameter name -> full shape
    dtypes: dict[str, str]  # HF parameter name -> torch dtype name
    # LoRA: the checkpoint holds the adapters alone (`params`), of this spec, trained on the base model `base`
    adapter: AdapterSpec | None = None
    base: str = ""
    # the critic's value model (checkpoint/critic.py): DCP key -> full shape, and -> dtype; empty without one
    critic: dict[str, list[int]] = {}
    critic_dtypes: dict[str, str] = {}
    # a LoRA critic (critic.lora): `critic` holds its adapters and head alone, of this spec, on the base `critic_base`
    critic_adapter: AdapterSpec | None = None
    critic_base: str = ""


def trained_names(lm: nn.Module) -> set[str] | None:
    """The parameters a checkpoint holds when some are frozen (LoRA: the adapters); None: all of them."""
    names = {n for n, p in lm.named_parameters() if p.requires_grad}
    return names if len(names) < sum(1 for _ in lm.parameters()) else None


def state_dict_options(module: nn.Module):
    """State-dict options: with frozen parameters (a LoRA base, the actor's or the critic's) only the trained ones
    are saved and loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = trained_names(module) is not None
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def fingerprint(lm: nn.Module) -> dict[str, object]:
    """The architecture fields a checkpoint must share with the model it is loaded into."""
    config = lm.config.to_dict()
    return {k: config.get(k) for k in _FINGERPRINT_FIELDS if k in config}


def param_shapes(lm: nn.Module) -> tuple[dict[str, list[int]], dict[str, str]]:
    shapes, dtypes, trained = {}, {}, trained_names(lm)
    for name, value in lm.state_dict().items():
        if trained is not None and name not in trained:
            continue
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
    raise CheckpointError(_none_at(path))


def _none_at(path: pathlib.Path) -> str:
    """Why there is no checkpoint at `path`: a run that saved none (and how to make it save), or a wrong path."""
    run = next((p for p in (path, path.parent, path.parent.parent) if (p / "config.toml").is_file()), None)
    if run is None:
        return f"no checkpoint at {path}: give a step_N folder holding {META}, a run folder or its checkpoints/"
    saved = list_checkpoints(checkpoints_dir(run))
    if saved:
        return f"no checkpoint at {path}; run {run} saved {', '.join(p.name for _, p in saved)}"
    import tomllib

    try:
        said = tomllib.loads((run / "config.toml").read_text()).get("checkpoint", {})
    except (OSError, tomllib.TOMLDecodeError):
        said = {}
    settings = ", ".join(f"checkpoint.{k} = {said[k]}" for k in ("every", "budget") if k in said)
    return (
        f"run {run} saved no checkpoint{f' ({settings})' if settings else ''}, or ended before its first: run it "
        "again with --set checkpoint.every=N (one every N steps and one at the last step)"
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


class DiskFullError(CheckpointError):
    """A checkpoint that does not fit on its disk (checked before a save, or ENOSPC while writing one)."""


def check_writable(root: pathlib.Path, need_bytes: int) -> None:
    """Fail early: the folder can be created and written, and the disk has room for a checkpoint."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFullError(f"no room for a checkpoint in {root}: the disk is full") from None
        raise CheckpointError(
            f"checkpoint folder {root} is not writable ({e.strerror}); set run.dir to a writable folder"
        ) from None
    free = shutil.disk_usage(root).free
    if free < need_bytes:
        raise DiskFullError(
            f"not enough disk for a checkpoint in {root}: about {need_bytes / 2**20:.1f} MiB "
            f"needed, {free / 2**20:.1f} MiB free; free space, lower checkpoint.keep_last, "
            "or point run.dir elsewhere"
        )


ITEM_BYTES = 2560  # each tensor DCP writes: its torch.save framing, its entries in .metadata and meta.json
RANK_BYTES = 32 << 10  # extra.pt: the LR schedule and each rank's RNG states
HUB_FILES_BYTES = 16 << 20  # the tokenizer and config files of a model named on the Hub (not measured)


def checkpoint_bytes(weights: int, trained: int, tensors: int, hf_files: int, ranks: int = 1) -> int:
    """A checkpoint's size on disk: the trained weights as the state dict holds them (`weights` bytes, a tied
    head twice), AdamW's two moments of the `trained` parameters' bytes, the framing of each of `tensors` (the
    state dict's and 3 optimizer entries a parameter), the RNG states of `ranks`, the HF files beside them."""
    return weights + 2 * trained + ITEM_BYTES * tensors + RANK_BYTES * ranks + hf_files


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def side_files(source: pathlib.Path) -> list[pathlib.Path]:
    """A model folder's files that are not weights (config, tokenizer, ...): an export needs them."""
    return [
        f
        for f in source.iterdir()
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _INDEX_FILES
    ]


def hf_files_bytes(model_source: str) -> int:
    """What a checkpoint's hf/ folder takes: the model folder's `side_files` (`store.write_hf_files` copies
    them) and the config written beside them; a Hub name's are guessed (HUB_FILES_BYTES)."""
    source = pathlib.Path(model_source) if model_source else None
    if source is None or not source.is_dir():
        return HUB_FILES_BYTES if model_source else 4096
    return 4096 + sum(f.stat().st_size for f in side_files(source))


def estimate_bytes(lm: nn.Module, model_source: str = "", ranks: int = 1) -> int:
    """The disk a checkpoint of `lm` takes (`checkpoint_bytes`): the trained parameters (LoRA: the adapters')."""
    trained = trained_names(lm)
    state = {k: v for k, v in lm.state_dict().items() if trained is None or k in trained}
    params = [p for p in lm.parameters() if p.requires_grad]
    weights = sum(v.numel() * v.element_size() for v in state.values())
    moments = sum(p.numel() * p.element_size() for p in params)
    return checkpoint_bytes(weights, moments, len(state) + 3 * len(params), hf_files_bytes(model_source), ranks)
