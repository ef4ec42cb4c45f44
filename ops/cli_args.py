"""What every command of the `streamrl` command line shares (cli.py's roles, ops/commands.py's tools):
the common options, the config read once from a file and overrides, the preflight that refuses a role's
bad inputs before anything starts, and the process's GPUs and exit."""

from __future__ import annotations

import pathlib
from typing import Annotated

import typer

ConfigOpt = Annotated[pathlib.Path | None, typer.Option("--config", "-c", help="TOML config file.")]
ResumeOpt = Annotated[
    str,
    typer.Option(
        "--resume",
        metavar="PATH|latest",
        help="Continue from a checkpoint: a step folder, or latest in the run folder.",
    ),
]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override: section.field=value (repeatable).")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show the traceback behind a config or preflight error.")]
PreflightOpt = Annotated[
    bool,
    typer.Option(
        "--preflight/--no-preflight",
        help="Check the config, model, engine, data and rewards before starting (seconds; exit 2 on an error).",
    ),
]

GpusOpt = Annotated[str, typer.Option("--gpus", help="GPUs of this host for this role, e.g. 0 or 0,1.")]


def load(config: pathlib.Path | None, overrides: list[str] | None, debug: bool = False):
    """The config of the file and overrides."""
    return load_role(config, overrides, debug, implied=False)[0]


def load_role(config: pathlib.Path | None, overrides: list[str] | None, debug: bool = False, implied: bool = True):
    """(The config of the file and overrides, with what its data source implies: a library's reward,
    prompt length, environment (rollout/envs/libraries.py); one line saying what that filled, or '').
    The line is said by `preflight_or_exit` once the source passed, so a refused source is not first announced."""
    from streamrl.engine.config import ConfigError, build, given, read

    try:
        data = read(config)
        cfg, said = build(data, overrides or []), ""
        if implied:
            from streamrl.rollout.envs.libraries import implied as implied_by

            extra, said = implied_by(given(data, overrides or []), cfg)
            if extra:
                cfg = build(data, [*(overrides or []), *extra])
        return cfg, said
    except ConfigError as e:
        if debug:
            raise
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None


def preflight_or_exit(cfg, roles: list[str], debug: bool, nodes: int = 1, said: str = ""):
    """Stop with exit 2, one line per problem, when a role would fail on its inputs; before any
    process starts or any model loads (ops/preflight.py). `said`: what the data source filled in, told
    when nothing stops the command. Returns `cfg`, with run.mode = 'auto' set to what preflight chose."""
    import msgspec

    from streamrl.ops.preflight import preflight as check
    from streamrl.ops.preflight import report

    found = check(cfg, roles, nodes)
    code = report(found, debug)
    if code:
        raise typer.Exit(code)
    if said:
        typer.echo(f"info: {said}", err=True)
    if not found.mode:
        return cfg
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, mode=found.mode))


def write_run_config(cfg, given: pathlib.Path | None) -> None:
    """RUN/config.toml: the config this learner runs, which `streamrl rollout --config` takes to join it."""
    from streamrl.engine.config import dump
    from streamrl.engine.redis_server import write_private

    path = cfg.run.path / "config.toml"
    if given is not None and path.exists() and given.resolve() == path.resolve():
        return  # `streamrl run` wrote it and started this learner from it
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, dump(cfg))  # 0600: ledger.url may hold a Redis password


def use_gpus(gpus: str) -> None:
    """Restrict this process (and what it starts) to `gpus`, before anything initialises CUDA."""
    import os

    if gpus:
        if not all(part.strip().isdigit() for part in gpus.split(",")):
            typer.secho(f"error: --gpus {gpus!r}: give GPU indices, e.g. 0 or 0,1", fg="red", err=True)
            raise typer.Exit(2)
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus


def exit_now(code: int) -> None:
    """Exit with `code` once logs are flushed, without the interpreter's teardown: a weight-transfer
    thread still inside gloo or NCCL then aborts the process ("terminate called without an active
    exception", seen at the end of a run whose last push was still going to a slow node)."""
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
