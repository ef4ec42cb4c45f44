"""Every `streamrl COMMAND --option ...` the code base, its docs and its examples tell a user to type
names a real command and real options of it (issue 19: a hint named `--run`, which does not exist)."""

from __future__ import annotations

import pathlib
import re

import click
import typer

import streamrl
from streamrl.cli import app
from streamrl.engine.config import build

ROOT = pathlib.Path(streamrl.__file__).parent
MENTION = re.compile(r"\bstreamrl ([a-z][a-z-]*)([^\n`'\"();]*)")


def commands() -> dict[str, click.Command]:
    return typer.main.get_command(app).commands


def options_of(command: click.Command) -> set[str]:
    """The command's options, and the --help that click gives every command."""
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"--help"}


def mentions() -> list[tuple[str, str, str]]:
    """(file:line, command, the text after it) for each `streamrl WORD ...` in source, docs and examples."""
    files = [p for ext in ("py", "md", "toml", "sh") for p in ROOT.rglob(f"*.{ext}")]
    found = []
    for path in files:
        if "tests" in path.relative_to(ROOT).parts or ".venv" in path.parts:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in MENTION.finditer(line):
                found.append((f"{path.relative_to(ROOT)}:{number}", match.group(1), match.group(2)))
    return found


def check(where: str, name: str, rest: str, known: dict[str, click.Command]) -> list[str]:
    options = [token.split("=")[0].strip("[]") for token in rest.split() if token.lstrip("[").startswith("-")]
    if name not in known:
        # prose ("streamrl does not pass ...") has no options; a command with options must exist
        return [f"{where}: `streamrl {name}` is not a command"] if options else []
    real = options_of(known[name])
    if known[name].context_settings.get("ignore_unknown_options"):  # `bench NAME ...`: the benchmark's own
        return []
    return [f"{where}: `streamrl {name} {option}`: no such option" for option in options if option not in real]


def test_every_streamrl_command_in_the_code_base_names_real_options():
    known = commands()
    found = mentions()
    assert len([m for m in found if m[1] in known]) > 20  # the scan reads the hints (README, docs, code)
    problems = [p for m in found for p in check(*m, known)]
    assert problems == []


def test_the_check_catches_the_hint_of_issue_19():
    # the learner's old waiting hint, and a misspelled command
    assert check("x:1", "rollout", " --run NAME", commands()) == ["x:1: `streamrl rollout --run`: no such option"]
    assert check("x:2", "rolout", " --learner RUN", commands()) == ["x:2: `streamrl rolout` is not a command"]


def test_the_learners_waiting_hint_is_the_launchers_node_command(tmp_path):
    """The learner (learner/admission.py) and `streamrl run --rollout-nodes 0` (ops/launcher.py)
    print the same command; tests/integration/test_first_hour_run.py runs it."""
    from streamrl.learner.admission import Admission
    from streamrl.ops.launcher import Launcher

    cfg = build({}, [f"run.dir={str(tmp_path)!r}", "run.name='hint'"])
    hint = Admission(cfg, None, None, lambda: 0, serve=lambda: None, node_count=lambda: 0).hint()  # no node registered
    launcher = Launcher(cfg)
    try:
        assert hint == f"no rollout node registered; start one with `{launcher.node_command()}`"
    finally:
        launcher.stop_all()
    run = tmp_path / "hint"
    assert launcher.node_command() == f"streamrl rollout --config {run / 'config.toml'} --learner {run}"
