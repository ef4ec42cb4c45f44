"""Typed configuration: one Struct per component, loaded from TOML plus dotted overrides.

Every field carries its documentation in `Meta(description=...)` and its allowed range in
`Meta(ge=..., le=...)`, so a bad value fails when the config is built with an error that names
the field's path, the value and what is allowed (`ConfigError`). Unknown keys are errors too:
a typo never silently falls back to a default.
"""

from __future__ import annotations

import pathlib
import re
import tomllib
import typing
from typing import Annotated, Any, Literal

import msgspec

from streamrl.engine.config import presets
from streamrl.engine.config.base import ConfigError, PosInt, _doc, _Section
from streamrl.engine.config.critic import CriticConfig
from streamrl.engine.config.eval import EvalConfig
from streamrl.engine.config.learner import CheckpointConfig, LearnerConfig, LossConfig
from streamrl.engine.config.lora import LoraConfig
from streamrl.engine.config.rollout import (
    DataConfig,
    EnvConfig,
    RewardConfig,
    RewardModelConfig,
    RolloutConfig,
    SimulateConfig,
)
from streamrl.engine.config.wire import LedgerConfig, TransportConfig, WeightsConfig

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "LearnerConfig",
    "LedgerConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "PosInt",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SimulateConfig",
    "TelemetryConfig",
    "TransportConfig",
    "WeightsConfig",
    "apply_override",
    "build",
    "dump",
    "given",
    "load",
    "read",
]


class RunConfig(_Section):
    name: Annotated[
        str,
        _doc("Run id; Redis keys and the run folder are named after it.", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$"),
    ] = "demo"
    dir: Annotated[str, _doc("Folder that holds every run's folder (logs, metrics, checkpoints).")] = "runs"
    seed: Annotated[int, _doc("Seed for model init, sampling and data order.", ge=0)] = 0
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        _doc("Where the learner and the rollout engines run; auto picks cuda when present."),
    ] = "auto"
    steps: Annotated[int, _doc("Learner steps (batches, one policy version each) to run before stopping.", ge=1)] = 20
    mode: Annotated[
        Literal["auto", "async", "sync"],
        _doc("async: nodes generate ahead, within ledger.max_staleness versions; sync: the classic loop, one "
             "step's groups generated with the newest weights, then trained, then pushed (the baseline), a vLLM "
             "node on the learner's device asleep (KV cache released) while the learner trains; auto: async, "
             "or sync where the learner and vLLM nodes share a GPU that holds both only that way (preflight "
             "says which)."),
    ] = "auto"  # fmt: skip

    @property
    def path(self) -> pathlib.Path:
        return pathlib.Path(self.dir) / self.name


class ModelConfig(_Section):
    path: Annotated[
        str,
        _doc(
            "Local HF model folder (or hub id where a hub is reachable). "
            "Empty: the built-in tiny model, made on first use."
        ),
    ] = ""
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        _doc("Parameter dtype of the rollout engines and the learner's compute."),
    ] = "float32"
    trust_remote_code: Annotated[bool, _doc("Run code shipped with the model; off unless the model needs it.")] = False
    max_model_len: Annotated[int, _doc("Longest prompt + completion in tokens.", ge=16, le=1 << 20)] = 512


class TelemetryConfig(_Section):
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], _doc("Log level of rank 0.")] = "INFO"
    tensorboard: Annotated[bool, _doc("Also write TensorBoard events when tensorboard is installed.")] = True
    prometheus_port: Annotated[int, _doc("Serve Prometheus /metrics on this port; 0 disables.", ge=0, le=65535)] = 0
    prometheus_host: Annotated[
        str, _doc("Address the Prometheus endpoint binds; 0.0.0.0 lets a remote Prometheus scrape it.", min_length=1)
    ] = "127.0.0.1"
    wandb: Annotated[bool, _doc("Also log every step to Weights & Biases (needs `pip install wandb`).")] = False
    wandb_project: Annotated[str, _doc("W&B project; the run is named after run.name.", min_length=1)] = "streamrl"
    wandb_mode: Annotated[
        Literal["offline", "online"],
        _doc("offline writes to RUN/wandb with no network (sync later with `wandb sync`); online needs a login."),
    ] = "offline"


class Config(_Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    ledger: LedgerConfig = msgspec.field(default_factory=LedgerConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    simulate: SimulateConfig = msgspec.field(default_factory=SimulateConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)


def _parse_value(text: str) -> Any:
    """An override's value as TOML (numbers, bools, lists, quoted strings); else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `section.field=value` override to a raw config dict, in place."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} is not of the form section.field=value")
    parts = [p.strip() for p in key.split(".")]
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = _parse_value(value.strip())


def _describe(error: msgspec.ValidationError, data: dict[str, Any]) -> str:
    """Turn msgspec's `... - at `$.learner.lr`` into `learner.lr = VALUE: ...`."""
    message = str(error)
    text, sep, where = message.rpartition(" - at `")
    if not sep:
        text, where = message, "$"
    path = where.rstrip("`").removeprefix("$").lstrip(".")
    value: Any = data
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    unknown = re.match(r"Object contains unknown field `(.+)`", text)
    if unknown:
        section = _struct_at(path)
        allowed = ", ".join(section.__struct_fields__) if section else "?"
        field = f"{(path + '.') if path else ''}{unknown.group(1)}"
        return f"config field `{field}` does not exist; {path or 'top level'} allows: {allowed}"
    shown = f" = {value!r}" if value is not None and not isinstance(value, dict) else ""
    choices = _choices(path)
    return f"config field `{path}`{shown}: {text}" + (f"; allowed: {choices}" if choices else "")


def _struct_at(path: str) -> type | None:
    node: Any = Config
    for part in filter(None, path.split(".")):
        name, index, _ = part.partition("[")  # `eval.sources[0]`: an item of a list of sections
        node = typing.get_type_hints(node).get(name) if isinstance(node, type) else None
        if index and typing.get_origin(node) is list:
            node = typing.get_args(node)[0]
    return node if isinstance(node, type) and issubclass(node, msgspec.Struct) else None


def _choices(path: str) -> str:
    section, _, field = path.rpartition(".")
    struct = _struct_at(section)
    if struct is None or not field:
        return ""
    hint = typing.get_type_hints(struct, include_extras=True).get(field)
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    return ", ".join(map(repr, typing.get_args(hint))) if typing.get_origin(hint) is Literal else ""


# Fields that were renamed: a config that still sets one is refused with the new name (never silently ignored).
RENAMED = {
    ("learner", "updates_per_batch"): "learner.mini_batches (optimizer updates per pass over the batch; "
    "learner.epochs sets the passes, so a step takes mini_batches x epochs updates)"
}


def _refuse_renamed(data: dict[str, Any]) -> None:
    for (section, field), new in RENAMED.items():
        if isinstance(data.get(section), dict) and field in data[section]:
            raise ConfigError(f"config field `{section}.{field}` was renamed: use {new}")


def build(data: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Validate a raw dict (from TOML) plus overrides into a `Config`; raise `ConfigError` naming the field.
    `loss.preset` fills the [loss] fields the data does not give (engine/config/presets.py)."""
    data = given(data, overrides)  # a copy the overrides changed
    _refuse_renamed(data)
    try:
        cfg = msgspec.convert(data, Config)
        if cfg.loss.preset:
            data = presets.apply(data, cfg)
            cfg = msgspec.convert(data, Config)
        return _resolve_backend(cfg)
    except msgspec.ValidationError as e:
        raise ConfigError(_describe(e, data)) from None


def _resolve_backend(cfg: Config) -> Config:
    """`rollout.backend = "auto"`: vllm where this host has it installed (found without importing it), else hf."""
    if cfg.rollout.backend != "auto":
        return cfg
    import importlib.util

    backend = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, backend=backend))


def load(path: str | pathlib.Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a TOML file (or the defaults when `path` is None) and apply `--set` overrides."""
    return build(read(path), overrides)


def given(data: dict[str, Any], overrides: list[str] = ()) -> dict[str, Any]:
    """The raw config the file and the overrides give (what an explicit setting is), before defaults."""
    data = msgspec.convert(data, dict)
    for override in overrides:
        apply_override(data, override)
    return data


def read(path: str | pathlib.Path | None = None) -> dict[str, Any]:
    """A TOML config file as a raw dict ({} when `path` is None); ConfigError when it is missing or not TOML."""
    data: dict[str, Any] = {}
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    return data


def dump(config: Config) -> str:
    """The config as TOML text (for logs and the run folder); `build(tomllib.loads(dump(c))) == c`."""
    import tomli_w

    return tomli_w.dumps(msgspec.to_builtins(config))
