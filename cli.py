"""The `streamrl` command line: each command parses its config and calls one role's main().

The roles (learner, rollout, run) are here; the commands around them are ops/commands.py's (and
ops/eval_cli.py's), what every command shares ops/cli_args.py's. `COMMANDS` lists them in --help's order."""

from __future__ import annotations

from typing import Annotated

import typer

from streamrl.ops import commands
from streamrl.ops.cli_args import (
    ConfigOpt,
    DebugOpt,
    GpusOpt,
    PreflightOpt,
    ResumeOpt,
    SetOpt,
    exit_now,
    load_role,
    preflight_or_exit,
    use_gpus,
    write_run_config,
)
from streamrl.ops.eval_cli import eval_command

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Asynchronous off-policy RL for LLM post-training.",
)


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

    cfg, said = load_role(config, overrides, debug)
    if not gpus and cfg.learner.gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
        gpus = ",".join(map(str, cfg.learner.gpus))  # a launcher that placed us set the variable already
    use_gpus(gpus)
    if "RANK" not in os.environ and _own_run_folder(cfg) is None:  # torchrun's ranks run under its hold
        raise typer.Exit(2)
    if preflight and "RANK" not in os.environ:  # once, in the process the user started, not per rank
        try:
            preflight_or_exit(cfg, ["learner"], debug, said=said)
        except typer.Exit:
            if _OWNER is not None:
                _OWNER.abandon()  # a refused preflight leaves no folder behind, as under `streamrl run`
            raise
    if os.environ.get("RANK", "0") == "0":
        write_run_config(cfg, config)
    if cfg.learner.ranks > 1 and "RANK" not in os.environ:
        # become torchrun, which starts this same command once per rank; Ctrl-C and SIGTERM then
        # reach it (and so its workers) directly
        os.execv(
            sys.executable,
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.learner.ranks}",
             "-m", "streamrl", "learner", *sys.argv[2:], "--no-preflight"],
        )  # fmt: skip
    from streamrl.learner.main import main as learner_main

    exit_now(learner_main(cfg, resume))


def _own_run_folder(cfg):
    """The learner's hold on RUN (ops/lock.py), kept for the process's life; None when another process owns it."""
    from streamrl.ops.lock import own_or_refuse

    global _OWNER
    _OWNER = own_or_refuse(cfg.run.path)
    return _OWNER


_OWNER = None


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
    cfg, said = load_role(config, overrides, debug)
    if preflight:
        preflight_or_exit(cfg, ["rollout"], debug, said=said)
    from streamrl.rollout.service import main as rollout_main

    use_gpus(gpus)
    raise typer.Exit(rollout_main(cfg, learner, node_id, max_groups))


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
            help="Prompts: a .jsonl/.parquet file or a saved dataset folder, reasoning_gym:TASK (optionally :SIZE and "
            ":SEED after it) or verifiers:TASKSET_ID (the library's own scoring is then the reward); default: the demo "
            "task."
        ),
    ] = "",
    reward: Annotated[
        list[str] | None,
        typer.Option(
            help="Reward function(s), repeatable: a built-in name, module:function or path.py:function "
            "(TRL's reward signature works unchanged)."
        ),
    ] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, help="Optimizer steps (default: run.steps, 20; the demo's 30).")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="auto, cpu or cuda (default: run.device, auto: cuda where there is one).")
    ] = None,
    resume: ResumeOpt = "",
    fresh: Annotated[
        bool,
        typer.Option(
            help="Start the named run again from step 1, its earlier books (ledger, metrics, checkpoints, logs) "
            "kept in RUN/earlier/<time>/: for a run with nothing to resume."
        ),
    ] = False,
    debug: DebugOpt = False,
) -> None:
    """Everything on this machine: embedded Redis, a learner and N rollout nodes, with a live view.
    The config, model, engine, data and rewards are checked first (exit 2, nothing started, on an error)."""
    from streamrl.ops.lock import claim_run
    from streamrl.ops.naming import DEMO, TINY, name_sets

    tiny = config is None and not model  # the built-in tiny model: its settings (the demo's too), then yours
    sets = list(overrides or [])
    sets += [f"model.path={model!r}"] if model else []
    sets += [f"data.path={data!r}"] if data else []
    sets += [f"reward.functions={list(reward)!r}"] if reward else []
    sets += [f"run.steps={steps}"] if steps else []
    sets += [f"run.device={device!r}"] if device else []
    found = _resumed(config, sets, debug) if resume else None  # the run's config.toml, yours on top
    if found is None:
        sets = (TINY if tiny and data else DEMO if tiny else []) + sets
        named = name_sets(config, sets)
        cfg, said = load_role(config, sets + named, debug)
    else:
        (cfg, line), named, said = found, [], ""
        typer.echo(line, err=True)
    # a run named by you keeps its folder; a name made here gets a fresh one when taken. Owned before the
    # preflight: a second launcher on a live run is refused in seconds (ops/lock.py)
    claimed = claim_run(cfg, explicit_name=not named, resume=resume)
    if claimed is None:
        raise typer.Exit(2)
    cfg, owner = claimed
    with owner:  # a refused preflight leaves no folder
        cfg = preflight_or_exit(cfg, ["learner", "rollout"], debug, nodes=rollout_nodes, said=said)
        from streamrl.ops.run import run_local

        code = run_local(cfg, rollout_nodes, explicit_name=not named, resume=resume, owner=owner, fresh=fresh)
    raise typer.Exit(code)


def _resumed(config, sets: list[str], debug: bool):
    """ops/resumed.py's config of a resumed run; exit 2 with one line naming the field it refuses."""
    from streamrl.engine.config import ConfigError
    from streamrl.ops.resumed import resumed_config

    try:
        return resumed_config(config, sets)
    except ConfigError as e:
        if debug:
            raise
        typer.secho(f"error: {e}", fg="red", err=True)
        raise typer.Exit(2) from None


# every command, in --help's order (bench passes its extra arguments to the benchmark)
COMMANDS = {
    "doctor": commands.doctor,
    "make-tiny-model": commands.make_tiny_model,
    "learner": learner,
    "rollout": rollout,
    "status": commands.status,
    "run": run,
    "export": commands.export,
    "eval": eval_command,  # ops/eval_cli.py
    "bench": commands.bench,
    "reasoning-gym": commands.reasoning_gym,
    "keys": commands.keys,
}
for _name, _command in COMMANDS.items():
    _extra = {"allow_extra_args": True, "ignore_unknown_options": True} if _name == "bench" else None
    app.command(_name, context_settings=_extra)(_command)


def main() -> None:
    import atexit
    import gc

    # the last full collection at interpreter exit walks every object torch, transformers and vLLM made: 1.5 s
    # a process here, on the path of every run's end; frozen, the exit takes 0.2 s (open files still close)
    atexit.register(gc.freeze)
    app()


if __name__ == "__main__":
    main()
