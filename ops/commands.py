"""The `streamrl` commands around the roles (registered by cli.py): check the environment (`doctor`), make
a tiny model, read a run's books (`status`), export a checkpoint, run a benchmark, write a reasoning-gym
task, make CURVE keys. Each parses its arguments and calls one function of ops/ (or of the part it serves)."""

from __future__ import annotations

import pathlib
from typing import Annotated

import typer

from streamrl.ops.cli_args import ConfigOpt, SetOpt, load


def doctor(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    redis_url: Annotated[str, typer.Option(help="Check this Redis (default: ledger.url, else the embedded one).")] = "",
    deep: Annotated[bool, typer.Option(help="Also import the model's transformers class and vLLM (slower).")] = False,
) -> None:
    """Check the environment; every failing row names the command that fixes it."""
    from streamrl.ops.doctor import render, run_checks

    cfg = load(config, overrides)
    results = run_checks(
        model_path=cfg.model.path,
        redis_url=redis_url or cfg.ledger.url,
        host=cfg.transport.host,
        ports=[cfg.transport.trajectory_port, cfg.transport.control_port],
        tensorboard=cfg.telemetry.tensorboard,
        deep=deep,
    )
    raise typer.Exit(render(results))


def make_tiny_model(
    path: Annotated[pathlib.Path, typer.Argument(help="Folder to write the model and tokenizer to.")],
    seed: Annotated[int, typer.Option(help="Init and tokenizer seed; same seed, same bytes.")] = 0,
    shape: Annotated[
        str, typer.Option(help="Model body from engine/models.py's SHAPES, e.g. tiny, or 0.5b (Qwen2-0.5B's layers).")
    ] = "tiny",
    dtype: Annotated[str, typer.Option(help="Weights' dtype: float32, or bfloat16 (half the bytes).")] = "float32",
    device: Annotated[str, typer.Option(help="Where to initialise it: cpu, or cuda (seconds for a 7B shape).")] = "cpu",
    for_: Annotated[
        str, typer.Option("--for", help="reasoning_gym:TASK: the tiny model taught that task's answer format.")
    ] = "",
    train_steps: Annotated[int, typer.Option(min=1, help="With --for: the teaching steps (16 prompts each).")] = 150,
) -> None:
    """Write a random-init Qwen2 with a BPE tokenizer (for tests, first runs and GPU benchmarks; no hub needed);
    with --for, one taught the answer format of a reasoning-gym task, not its answers (ops/tiny_model.py)."""
    from streamrl.ops.tiny_model import make

    try:
        typer.echo(make(path, seed, shape, dtype, device, for_, train_steps))
    except (ImportError, ValueError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None


def status(
    run: Annotated[str, typer.Option("--run", help="Run id (run.name); default: the newest run in --runs-dir.")] = "",
    redis_url: Annotated[str, typer.Option(help="Redis URL; default: the run folder's embedded server.")] = "",
    runs_dir: Annotated[str, typer.Option(help="Folder holding run folders.")] = "runs",
    deep: Annotated[bool, typer.Option(help="Also recount every sample record.")] = False,
) -> None:
    """The run's books: generated, in flight, trained, dropped by reason; exit 1 when they do not balance."""
    from streamrl.ops.status import status_cli

    raise typer.Exit(status_cli(run, redis_url, pathlib.Path(runs_dir), deep))


def export(
    checkpoint: Annotated[
        pathlib.Path,
        typer.Argument(help="A checkpoint (RUN/checkpoints/step_N), or a run or checkpoints folder: its newest."),
    ],
    out: Annotated[pathlib.Path, typer.Argument(help="Folder to write the HF model to.")],
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors shard, e.g. 2GB, 500MB.")] = "2GB",
    overwrite: Annotated[bool, typer.Option(help="Replace a non-empty OUT.")] = False,
    merge: Annotated[bool, typer.Option(help="LoRA: the base model with the adapter merged in, not the adapter.")] = (
        False
    ),
    base: Annotated[
        str,
        typer.Option(
            help="LoRA: the base model folder (default: the run's model.path; with "
            "--critic, a LoRA critic's: critic.path, else model.path)."
        ),
    ] = "",
    critic: Annotated[
        bool, typer.Option(help="The critic's value model (a one-label sequence classifier), not the actor.")
    ] = False,
) -> None:
    """Write a checkpoint as an HF model folder (sharded safetensors, config, tokenizer) that
    transformers and vLLM load without streamrl; a LoRA run's as a PEFT adapter folder (or --merge);
    with --critic, a PPO run's value model."""
    from streamrl.learner.checkpoint import CheckpointError, resolve
    from streamrl.learner.export import ExportError
    from streamrl.ops.export import export_checkpoint

    try:
        folder = export_checkpoint(checkpoint, out, max_shard_size, overwrite, merge, base, critic=critic)
    except (CheckpointError, ExportError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    step = resolve(checkpoint)  # a run or checkpoints folder gives its newest: say which step that was
    typer.echo(f"exported to {folder}: {step.name.replace('_', ' ')} ({step})")


def _bench_help() -> str:
    from streamrl.bench import names

    return f"A module of bench/ (`streamrl bench` alone says what each measures): {', '.join(names())}"


def bench(ctx: typer.Context, name: Annotated[str, typer.Argument(help=_bench_help())] = "") -> None:
    """Run a benchmark; it prints one JSON line per figure (extra arguments go to the benchmark). Without a
    name: the list of benchmarks."""
    import runpy
    import sys

    from streamrl.bench import catalogue

    known = catalogue()
    if not name:
        width = max(map(len, known))
        typer.echo("\n".join(f"{k:<{width}}  {v}" for k, v in known.items()))
        typer.echo("run one: streamrl bench NAME [its options]; streamrl bench NAME --help for them")
        return
    if name not in known:
        typer.secho(f"error: unknown benchmark {name!r}; choose one of {', '.join(known)}", fg="red", err=True)
        raise typer.Exit(2)
    sys.argv = [f"streamrl bench {name}", *ctx.args]
    runpy.run_module(f"streamrl.bench.{name}", run_name="__main__")


def reasoning_gym(
    name: Annotated[str, typer.Argument(help="Task name, e.g. basic_arithmetic.")],
    out: Annotated[pathlib.Path, typer.Option(help="The .jsonl file to write.")],
    size: Annotated[int, typer.Option(min=1, help="Rows.")] = 1000,
    seed: Annotated[int, typer.Option(help="The task generator's seed.")] = 0,
) -> None:
    """Write a reasoning-gym task as jsonl prompt rows for data.path (needs the reasoning-gym package)."""
    from streamrl.rollout.envs.reasoning_gym import write_rows

    try:
        count = write_rows(name, size, seed, out)
    except (ImportError, ValueError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{count} rows written to {out}")


def keys(
    folder: Annotated[pathlib.Path, typer.Argument(help="Folder for the keys (made 0700; kept keys are reused).")],
    node: Annotated[
        str, typer.Option(help="Also make a node's own folder FOLDER/NODE (its pair and the learner's public key).")
    ] = "",
) -> None:
    """Make CURVE keys for runs across hosts: the learner's pair, a node pair, the node keys it lets in.
    Give the folder as transport.keys on the learner, and on each node the folder or a copy of the node's half
    (CURVE is on by default: transport.curve)."""
    from streamrl.engine.auth import AuthError, make_keys

    try:
        where = make_keys(folder, node)
    except (AuthError, OSError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"learner: {folder}/server.key_secret and {folder}/authorized/ (the node keys it lets in)")
    typer.echo(f"node{' ' + node if node else 's'}: {where}/server.key and {where}/node.key_secret")
