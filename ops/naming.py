"""The names and settings of a `streamrl run` decided before anything starts: the built-in tiny model's settings,
the name of a run its config does not name, and a fresh folder for a default-named run whose folder exists.

Light to import (no torch): `streamrl run` reads these, then owns its folder (ops/lock.py `claim_run`), before
the preflight and the launcher load the heavy parts.
"""

from __future__ import annotations

import pathlib
import re
import time

import msgspec

from streamrl.engine.config import Config, ConfigError

# The built-in tiny model's settings, whatever the data (`streamrl run` without --model or --config): a
# learning rate this high suits only a tiny random model (real models want ~1e-6), and its completions are
# noise past a few tokens. examples/demo.toml spells them out.
TINY = ["learner.lr=1e-2", "rollout.group_size=8", "rollout.max_tokens=24"]
# The built-in demo: the random-init tiny model learns to write the letter of the demo task's
# `answer` column. Measured on 2 CPU cores with 2 nodes: mean reward 0.06 -> 1.0 in 30 steps.
DEMO = [*TINY, "run.steps=30"]


def name_after(config: str | None, data: str) -> str:
    """The name of a run its config does not name: the config file's stem, else the data source's (a file's
    stem, a library task's or taskset's id), else `demo` (the built-in demo)."""
    if config:
        base = pathlib.Path(config).stem
    elif data.startswith(("reasoning_gym:", "verifiers:")):
        base = data.split(":")[1]
    else:
        base = pathlib.Path(data).stem if data else "demo"
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.") or "run"


def name_sets(config: pathlib.Path | None, sets: list[str]) -> list[str]:
    """`run.name=...` for a run that neither the config nor `--set` names (`name_after`); [] when it is
    named (or the config cannot be read: loading it says why)."""
    from streamrl.engine.config import given, read

    try:
        raw = given(read(config), sets)
    except ConfigError:
        return []
    if "name" in raw.get("run", {}):
        return []
    return [f"run.name={name_after(config and str(config), str(raw.get('data', {}).get('path', '')))!r}"]


def fresh_name(cfg: Config, explicit: bool) -> Config:
    """A default-named run whose folder exists gets a timestamped name; an explicit name is kept."""
    if explicit or not cfg.run.path.exists():
        return cfg
    run = msgspec.structs.replace(cfg.run, name=f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    return msgspec.structs.replace(cfg, run=run)
