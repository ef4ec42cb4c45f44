"""The config of a resumed `streamrl run`: the run folder's config.toml (the effective config its first launch
wrote), with what this command line gives (--config, --set, --model, ...) on top, each change named on the
console; a field the checkpoint pins (the model, its adapters) is refused with one line naming it.

The folder is found without the first launch's config: run.name from --set (or the name `streamrl run` would
give it, ops/naming.py), run.dir from --set or its default. Light to import (no torch), as ops/naming.py.
"""

from __future__ import annotations

import pathlib
import tomllib
from typing import Any

import msgspec

from streamrl.engine.config import Config, ConfigError, RunConfig, build, given, read

# What a resume cannot change: the checkpoint holds this model's weights (and adapters) and nothing else
# (learner/checkpoint/layout.py check_compatible refuses another architecture, later and with less said)
PINNED = ("model.path", "lora.")


def resumed_config(config: pathlib.Path | None, sets: list[str]) -> tuple[Config, str] | None:
    """(The run's config.toml with `config` and `sets` on top; the console line naming each change), or None
    when the run folder has no config.toml (then the command line alone, as for a new run).
    ConfigError naming the field when a pinned one changes."""
    from streamrl.ops.naming import name_after

    mine = given(read(config), sets)  # what this command line says, before defaults
    run = mine.get("run", {})
    name = run.get("name") or name_after(config and str(config), str(mine.get("data", {}).get("path", "")))
    folder = pathlib.Path(run.get("dir", RunConfig().dir)) / name
    path = folder / "config.toml"
    if not path.is_file():
        return None
    try:
        base = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML ({e}); resume with the run's --config and --set") from None
    if (folder / "redis").is_dir():
        base.get("ledger", {}).pop("url", None)  # the earlier launch's embedded Redis: this launch starts its own
    mine.setdefault("run", {})["name"] = name
    before, after = build(base), build(_merge(base, mine))
    changes = [(key, old, new) for key, (old, new) in _differences(before, after).items() if key != "ledger.url"]
    for key, old, new in changes:
        if key.startswith(PINNED):
            raise ConfigError(
                f"{key} cannot change on a resume: its checkpoints hold {old!r} ({new!r} given); "
                f"drop it to resume, or start another run (another run.name, or --fresh)"
            )
    changed = "; ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes) or "nothing"
    return after, f"resuming {name} from its config.toml ({path}); changed on the command line: {changed}"


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`base` with `top`'s values over it, section by section."""
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def _differences(before: Config, after: Config) -> dict[str, tuple[Any, Any]]:
    """section.field -> (before, after) for every field that differs."""
    old, new = _flat(msgspec.to_builtins(before)), _flat(msgspec.to_builtins(after))
    keys = sorted(old.keys() | new.keys())
    return {key: (old.get(key), new.get(key)) for key in keys if old.get(key) != new.get(key)}


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
