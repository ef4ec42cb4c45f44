"""The `streamrl` command line: each command parses its config and calls one role's main()."""

from __future__ import annotations

import pathlib
from typing import Annotated

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Asynchronous off-policy RL for LLM post-training.",
)

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


def _load(config: pathlib.Path | None, overrides: list[str] | None, debug: bool = False):
    """The config of the file and overrides."""
    return _load_role(config, overrides, debug, implied=False)[0]


def _load_role(config: pathlib.Path | None, overrides: list[str] | None, debug: bool = False, implied: bool = True):
    """(The config of the file and overrides, with what its data source implies: a library's reward,
    prompt length, environment (rollout/envs/libraries.py); one line saying what that filled, or '').
    The line is said by `_preflight` once the source passed, so a refused source is not first announced."""
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


def _preflight(cfg, roles: list[str], debug: bool, nodes: int = 1, said: str = ""):
    """Stop with exit 2, one line per problem, when a role would fail on its inputs; before any
    process starts or any model loads (ops/preflight.py). `said`: what the data source filled in, told
    when nothing stops the command. Returns `cfg`, with run.mode = 'auto' set to what preflight chose."""
    import msgspec

    from streamrl.ops.preflight import preflight, report

    found = preflight(cfg, roles, nodes)
    code = report(found, debug)
    if code:
        raise typer.Exit(code)
    if said:
        typer.echo(f"info: {said}", err=True)
    if not found.mode:
        return cfg
    return msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, mode=found.mode))


def _write_run_config(cfg, given: pathlib.Path | None) -> None:
    """RUN/config.toml: the config this learner runs, which `streamrl rollout --config` takes to join it."""
    from streamrl.engine.config import dump
    from streamrl.engine.redis_server import write_private

    path = cfg.run.path / "config.toml"
    if given is not None and path.exists() and given.resolve() == path.resolve():
        return  # `streamrl run` wrote it and started this learner from it
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, dump(cfg))  # 0600: ledger.url may hold a Redis password


@app.command()
def doctor(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    redis_url: Annotated[str, typer.Option(help="Check this Redis (default: ledger.url, else the embedded one).")] = "",
    deep: Annotated[bool, typer.Option(help="Also import the model's transformers class and vLLM (slower).")] = False,
) -> None:
    """Check the environment; every failing row names the command that fixes it."""
    from streamrl.ops.doctor import render, run_checks

    cfg = _load(config, overrides)
    results = run_checks(
        model_path=cfg.model.path,
        redis_url=redis_url or cfg.ledger.url,
        host=cfg.transport.host,
        ports=[cfg.transport.trajectory_port, cfg.transport.control_port],
        tensorboard=cfg.telemetry.tensorboard,
        deep=deep,
    )
    raise typer.Exit(render(results))


@app.command("make-tiny-model")
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


GpusOpt = Annotated[str, typer.Option("--gpus", help="GPUs of this host for this role, e.g. 0 or 0,1.")]


def _use_gpus(gpus: str) -> None:
    """Restrict this process (and what it starts) to `gpus`, before anything initialises CUDA."""
    import os

    if gpus:
        if not all(part.strip().isdigit() for part in gpus.split(",")):
            typer.secho(f"error: --gpus {gpus!r}: give GPU indices, e.g. 0 or 0,1", fg="red", err=True)
            raise typer.Exit(2)
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus


@app.command()
def learner(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    resume: ResumeOpt = "",
    gpus: GpusOpt = "",
    preflight: PreflightOpt = True,
    debug: DebugOpt = False,
) -> None:
    """Run the learner (rank 0 binds the sockets); more ranks: learner.ranks, under torchrun."""
    import os
    import sys

    cfg, said = _load_role(config, overrides, debug)
    if not gpus and cfg.learner.gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
        gpus = ",".join(map(str, cfg.learner.gpus))  # a launcher that placed us set the variable already
    _use_gpus(gpus)
    if "RANK" not in os.environ and _own_run_folder(cfg) is None:  # torchrun's ranks run under its hold
        raise typer.Exit(2)
    if preflight and "RANK" not in os.environ:  # once, in the process the user started, not per rank
        _preflight(cfg, ["learner"], debug, said=said)
    if os.environ.get("RANK", "0") == "0":
        _write_run_config(cfg, config)
    if cfg.learner.ranks > 1 and "RANK" not in os.environ:
        # become torchrun, which starts this same command once per rank; Ctrl-C and SIGTERM then
        # reach it (and so its workers) directly
        os.execv(
            sys.executable,
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.learner.ranks}",
             "-m", "streamrl", "learner", *sys.argv[2:], "--no-preflight"],
        )  # fmt: skip
    from streamrl.learner.main import main as learner_main

    _exit_now(learner_main(cfg, resume))


def _own_run_folder(cfg):
    """The learner's hold on RUN (ops/lock.py), kept for the process's life; None when another process owns it."""
    from streamrl.ops.lock import own_or_refuse

    global _OWNER
    _OWNER = own_or_refuse(cfg.run.path)
    return _OWNER


_OWNER = None


def _exit_now(code: int) -> None:
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


@app.command()
def rollout(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    learner: Annotated[str, typer.Option(help="Learner control address tcp://HOST:PORT, or its run folder.")] = "",
    node_id: Annotated[str | None, typer.Option(help="Unique node name (default: host-pid).")] = None,
    max_groups: Annotated[int | None, typer.Option(min=1, help="Stop after starting this many groups.")] = None,
    gpus: GpusOpt = "",
    preflight: PreflightOpt = True,
    debug: DebugOpt = False,
) -> None:
    """Run one rollout node: register with the learner, take its weights, generate until stopped."""
    cfg, said = _load_role(config, overrides, debug)
    if preflight:
        _preflight(cfg, ["rollout"], debug, said=said)
    from streamrl.rollout.service import main as rollout_main

    _use_gpus(gpus)
    raise typer.Exit(rollout_main(cfg, learner, node_id, max_groups))


@app.command()
def status(
    run: Annotated[str, typer.Option("--run", help="Run id (run.name); default: the newest run in --runs-dir.")] = "",
    redis_url: Annotated[str, typer.Option(help="Redis URL; default: the run folder's embedded server.")] = "",
    runs_dir: Annotated[str, typer.Option(help="Folder holding run folders.")] = "runs",
    deep: Annotated[bool, typer.Option(help="Also recount every sample record.")] = False,
) -> None:
    """The run's books: generated, in flight, trained, dropped by reason; exit 1 when they do not balance."""
    from streamrl.ops.status import status_cli

    raise typer.Exit(status_cli(run, redis_url, pathlib.Path(runs_dir), deep))


@app.command()
def run(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    rollout_nodes: Annotated[
        int,
        typer.Option(
            min=0,
            help="Rollout processes to start; with 0 the learner waits for nodes you start (the command is printed).",
        ),
    ] = 2,
    model: Annotated[
        str, typer.Option(help="Local HF model folder (default: the built-in tiny model, lr 1e-2: ops/run.py TINY).")
    ] = "",
    data: Annotated[
        str,
        typer.Option(
            help="Prompts: a .jsonl/.parquet file or a saved dataset folder, reasoning_gym:TASK[:SIZE[:SEED]] or "
            "verifiers:TASKSET_ID (the library's own scoring is then the reward); default: the demo task."
        ),
    ] = "",
    reward: Annotated[
        list[str] | None,
        typer.Option(
            help="Reward function(s), repeatable: a built-in name, module:function or path.py:function "
            "(TRL's reward signature works unchanged)."
        ),
    ] = None,
    steps: Annotated[int | None, typer.Option(min=1, help="Optimizer steps.")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda.")] = None,
    resume: ResumeOpt = "",
    debug: DebugOpt = False,
) -> None:
    """Everything on this machine: embedded Redis, a learner and N rollout nodes, with a live view.
    The config, model, engine, data and rewards are checked first (exit 2, nothing started, on an error)."""
    from streamrl.ops.lock import claim_run
    from streamrl.ops.naming import DEMO, TINY, name_sets

    tiny = config is None and not model  # the built-in tiny model: its settings (the demo's too), then yours
    sets = (TINY if tiny and data else DEMO if tiny else []) + list(overrides or [])
    sets += [f"model.path={model!r}"] if model else []
    sets += [f"data.path={data!r}"] if data else []
    sets += [f"reward.functions={list(reward)!r}"] if reward else []
    sets += [f"run.steps={steps}"] if steps else []
    sets += [f"run.device={device!r}"] if device else []
    named = name_sets(config, sets)
    cfg, said = _load_role(config, sets + named, debug)
    # a run named by you keeps its folder; a name made here gets a fresh one when taken. Owned before the
    # preflight: a second launcher on a live run is refused in seconds (ops/lock.py)
    claimed = claim_run(cfg, explicit_name=not named, resume=resume)
    if claimed is None:
        raise typer.Exit(2)
    cfg, owner = claimed
    with owner:  # a refused preflight leaves no folder
        cfg = _preflight(cfg, ["learner", "rollout"], debug, nodes=rollout_nodes, said=said)
        from streamrl.ops.run import run_local

        code = run_local(cfg, rollout_nodes, explicit_name=not named, resume=resume, owner=owner)
    raise typer.Exit(code)


@app.command()
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
    base: Annotated[str, typer.Option(help="LoRA: the base model folder (default: the run's model.path).")] = "",
) -> None:
    """Write a checkpoint as an HF model folder (sharded safetensors, config, tokenizer) that
    transformers and vLLM load without streamrl; a LoRA run's as a PEFT adapter folder (or --merge)."""
    from streamrl.learner.checkpoint import CheckpointError
    from streamrl.learner.export import ExportError
    from streamrl.ops.export import export_checkpoint

    try:
        folder = export_checkpoint(checkpoint, out, max_shard_size, overwrite, merge, base)
    except (CheckpointError, ExportError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"exported to {folder}")


def _bench_help() -> str:
    from streamrl.bench import names

    return f"A module of bench/ (`streamrl bench` alone says what each measures): {', '.join(names())}"


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
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


@app.command("reasoning-gym")
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


@app.command()
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


def main() -> None:
    import atexit
    import gc

    # the last full collection at interpreter exit walks every object torch, transformers and vLLM made: 1.5 s
    # a process here, on the path of every run's end; frozen, the exit takes 0.2 s (open files still close)
    atexit.register(gc.freeze)
    app()


if __name__ == "__main__":
    main()
