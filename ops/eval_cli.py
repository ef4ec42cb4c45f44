"""The `streamrl eval` command's arguments (registered by cli.py: `app.command("eval")(eval_command)`); the
work is ops/eval.py's."""

from __future__ import annotations

import pathlib
from typing import Annotated

import typer


def eval_command(
    target: Annotated[
        str, typer.Argument(help="A model folder, a checkpoint (RUN/checkpoints/step_N) or a run folder (its newest).")
    ],
    data: Annotated[
        list[str] | None,
        typer.Option(
            "--data",
            "-d",
            help="A held-out source (data.path's forms); repeatable; added to the config's eval sources.",
        ),
    ] = None,
    out: Annotated[str, typer.Option(help="Folder for metrics.jsonl and eval/<source>/v<N>.jsonl.")] = "",
    config: Annotated[pathlib.Path | None, typer.Option("--config", "-c", help="TOML config file.")] = None,
    overrides: Annotated[
        list[str] | None, typer.Option("--set", "-s", help="Override: section.field=value (repeatable).")
    ] = None,
) -> None:
    """Evaluate a model, a checkpoint or a run's last version on held-out prompts: pass@k, mean@n, best@n,
    the samples to read (docs/EVALUATION.md). vLLM where installed, else transformers."""
    from streamrl.ops.eval import main

    raise typer.Exit(main(target, out, config, list(overrides or []), list(data or [])))
