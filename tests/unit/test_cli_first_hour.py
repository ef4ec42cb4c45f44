"""What a new user reads from the command line (issue 38): `streamrl bench` lists the benchmarks, `--help`
names the data sources, a run is named after its config or data, and help says a thing once, rightly."""

from __future__ import annotations

import pathlib

from typer.testing import CliRunner

import streamrl
from streamrl.bench import catalogue
from streamrl.cli import app
from streamrl.ops.run import name_after, name_sets

BENCH = pathlib.Path(streamrl.__file__).parent / "bench"


def invoke(*args: str, columns: int = 300) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.output


def test_bench_alone_lists_every_benchmark_with_what_it_measures():
    modules = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_"))
    assert "fault_figures" in modules and list(catalogue()) == modules
    listing = invoke("bench").splitlines()
    for name in modules:
        (line,) = [row for row in listing if row.split()[0] == name]
        assert len(line.split()) > 3, line  # a description follows the name
    assert "checkpoint          Checkpoint cost on one learner rank: DCP save, resume, HF export" in listing[1]
    help_text = " ".join(invoke("bench", "--help").split())
    assert all(name in help_text for name in modules), help_text


def test_run_help_names_the_library_sources():
    help_text = " ".join(invoke("run", "--help").split())
    assert "reasoning_gym:TASK (optionally :SIZE and :SEED after it)" in help_text
    assert "verifiers:TASKSET_ID" in help_text


def test_run_help_at_80_columns_cuts_no_cell_and_names_the_defaults():
    # issue 53: the --data cell read `reasoning_gym:TASK[:SIZE[:SEED…` (a word wider than its column)
    narrow = invoke("run", "--help", columns=80)
    assert "…" not in narrow and max(map(len, narrow.splitlines())) <= 80
    help_text = " ".join(narrow.replace("│", " ").split())
    assert "Optimizer steps (default: run.steps, 20; the demo's 30)." in help_text
    assert "auto, cpu or cuda (default: run.device, auto: cuda where there is one)." in help_text


def test_a_run_is_named_after_its_config_else_its_data():
    assert name_after("examples/lora.toml", "anything.jsonl") == "lora"
    assert name_after(None, "data/gsm8k.jsonl") == "gsm8k"
    assert name_after(None, "reasoning_gym:syllogism:64") == "syllogism"
    assert name_after(None, "verifiers:letter_taskset") == "letter_taskset"
    assert name_after(None, "saved dataset/") == "saved-dataset"
    assert name_after(None, "") == "demo"
    assert name_sets(None, ["data.path='x/rows.parquet'"]) == ["run.name='rows'"]
    # a name the config or --set gives is kept (and the run keeps its folder)
    assert name_sets(None, ["run.name='mine'", "data.path='rows.jsonl'"]) == []
    assert name_sets(pathlib.Path(streamrl.__file__).parent / "examples" / "lora.toml", []) == ["run.name='lora'"]


def test_a_run_named_in_its_config_keeps_the_name(tmp_path):
    (tmp_path / "exp.toml").write_text("[run]\nname = 'mine'\n")
    assert name_sets(tmp_path / "exp.toml", []) == []


def test_keys_help_does_not_ask_to_turn_curve_on():
    help_text = " ".join(invoke("keys", "--help").split())
    assert "transport.curve = true" not in help_text and "CURVE is on by default" in help_text


def test_a_refused_library_source_is_one_line_in_words(tiny_model, tmp_path, monkeypatch):
    """No Python exception name, the path said once, and no `info:` line of settings for a source that is
    refused; the same source spelled right is told what it filled (the positive control)."""
    import pytest

    pytest.importorskip("reasoning_gym")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--model", tiny_model, "--data", "reasoning_gym:syllogsm:8"])
    assert result.exit_code == 2, result.output
    assert (
        "error: data: data.path = reasoning_gym:syllogsm:8: reasoning-gym has no task 'syllogsm'; did you mean "
        "syllogism?\n" in result.output
    )
    assert "Error" not in result.output and "info: data.path" not in result.output
    assert not (tmp_path / "runs").exists()
    monkeypatch.setattr("streamrl.ops.run.run_local", lambda *a, **k: 0)  # stop right after preflight
    result = CliRunner().invoke(app, ["run", "--model", tiny_model, "--data", "reasoning_gym:syllogism:8"])
    assert result.exit_code == 0, result.output
    assert "info: data.path = reasoning_gym:syllogism:8 is a reasoning_gym source: reward.functions = " in result.output
