"""The `streamrl` command line: each command parses its config and calls one role's main()."""

from __future__ import annotations

import pathlib
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Asynchronous off-policy RL for LLM post-training.")

ConfigOpt = Annotated[Optional[pathlib.Path], typer.Option("--config", "-c", help="TOML config file.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", help="Override: section.field=value (repeatable).")]


def _load(config: pathlib.Path | None, overrides: list[str] | None):
    from streamrl.engine.config import ConfigError, load

    try:
        return load(config, overrides or [])
    except ConfigError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None


@app.command()
def doctor(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    redis_url: Annotated[str, typer.Option(help="Check this Redis (default: ledger.url, else the embedded one).")] = "",
) -> None:
    """Check the environment; every failing row names the command that fixes it."""
    from streamrl.engine.doctor import render, run_checks

    cfg = _load(config, overrides)
    results = run_checks(model_path=cfg.model.path, redis_url=redis_url or cfg.ledger.url,
                         host=cfg.transport.host, ports=[cfg.transport.trajectory_port, cfg.transport.control_port])
    raise typer.Exit(render(results))


@app.command("make-tiny-model")
def make_tiny_model(
    path: Annotated[pathlib.Path, typer.Argument(help="Folder to write the model and tokenizer to.")],
    seed: Annotated[int, typer.Option(help="Init and tokenizer seed; same seed, same bytes.")] = 0,
) -> None:
    """Write a random-init tiny Qwen2 with a BPE tokenizer (for tests and first runs; no hub needed)."""
    from streamrl.engine.models import make_tiny_model as make

    folder = make(path, seed=seed)
    typer.echo(f"tiny model written to {folder}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
