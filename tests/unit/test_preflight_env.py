"""Preflight's env check (issue 38): every name a rollout node resolves from [env] — the environment class,
its tools, its constructor's keywords, skyrl-gym's ids — is refused in one line before any process starts,
and what the node can run passes (the positive controls)."""

from __future__ import annotations

import json

import pytest

from streamrl.engine.config import build
from streamrl.ops import preflight as pf


def env_errors(tiny_model: str, *sets: str) -> list[str]:
    cfg = build({}, [f"model.path={tiny_model!r}", "run.device='cpu'", *sets])
    report = pf.preflight(cfg, pf.ROLES)
    assert all("\n" not in p.message for p in report.problems)
    assert [p.check for p in report.errors] == ["env"] * len(report.errors), [str(p) for p in report.errors]
    return [p.message for p in report.errors]


def test_an_environment_name_that_does_not_exist(tiny_model):
    assert env_errors(tiny_model, "env.name='no_such_env'") == [
        "env.name = 'no_such_env' is not a registered name (echo_target, tools, reasoning_gym, skyrl_gym) nor of "
        "the form `module:name` or `path.py:name`"
    ]


def test_a_tool_that_does_not_exist(tiny_model):
    (message,) = env_errors(tiny_model, "env.name='tools'", "env.tools=['calculator', 'no_such_tool']")
    assert message.startswith("env.tools = 'no_such_tool' is not a registered name (calculator)")


def test_environment_arguments_its_class_does_not_take(tiny_model):
    (message,) = env_errors(tiny_model, "env.name='reasoning_gym'", "env.args={atempts = 2}")
    assert message.startswith("env.args = {'atempts': 2} do not fit ReasoningGymEnv(attempts, feedback): ")
    assert message.endswith("got an unexpected keyword argument 'atempts'")
    # a tool environment is given its `toolbox` by the node: that keyword is not the user's mistake
    assert env_errors(tiny_model, "env.name='tools'", "env.tools=['calculator']") == []


def skyrl_rows(tmp_path, env_classes: list[str | None]) -> str:
    rows = [
        {"prompt": [{"role": "user", "content": f"{i} + {i}?"}], "reward_spec": {"ground_truth": str(2 * i)}}
        | ({"env_class": c} if c else {})
        for i, c in enumerate(env_classes)
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"data.path={str(path)!r}"


def test_skyrl_gym_ids_the_library_has_not_registered(tiny_model, tmp_path):
    pytest.importorskip("skyrl_gym")
    sky = ("env.name='skyrl_gym'", "data.messages_column='prompt'")
    assert env_errors(tiny_model, *sky, skyrl_rows(tmp_path, ["gsm8k", "gsm8k_multi_turn"])) == []
    (message,) = env_errors(tiny_model, *sky, skyrl_rows(tmp_path, ["gsm8k", "gsm8k_typo", "gsm8k_typo"]))
    assert message.startswith("env_class 'gsm8k_typo' in data.path is not a skyrl-gym id; registered: aime, gsm8k,")
    (message,) = env_errors(tiny_model, *sky, skyrl_rows(tmp_path, ["gsm8k", None]))
    assert message == "1 of 2 rows in data.path have no env_class; give each one, or env.args.env_id"
    ok = skyrl_rows(tmp_path, [None, None])
    assert env_errors(tiny_model, *sky, ok, "env.args={env_id = 'gsm8k'}") == []
    (message,) = env_errors(tiny_model, *sky, ok, "env.args={env_id = 'gsm9k'}")
    assert message.startswith("env.args.env_id = 'gsm9k' is not a skyrl-gym id; registered: aime, gsm8k,")


def test_a_skyrl_gym_entry_point_of_your_own_runs_without_registering(tiny_model, tmp_path, monkeypatch):
    """examples/skyrl/letter_env.py: rows naming `letter_env:LetterEnv` pass preflight and run through the adapter
    (skyrl-gym makes it from its EnvSpec); an entry point that does not import is refused (the control)."""
    pytest.importorskip("skyrl_gym")
    import pathlib

    examples = pathlib.Path(__file__).resolve().parents[2] / "examples" / "skyrl"
    monkeypatch.syspath_prepend(str(examples))
    letter_env = __import__("letter_env")
    path = tmp_path / "letters.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in letter_env.rows(8)))
    sky = ("env.name='skyrl_gym'", "data.messages_column='prompt'", f"data.path={str(path)!r}")
    assert env_errors(tiny_model, *sky) == []
    from streamrl.rollout.envs.skyrl import SkyRLGymEnv

    env, row = SkyRLGymEnv(), letter_env.rows(1)[0]  # asks for "e"
    assert env.reset(row) == row["prompt"]
    assert env.step("e e f") == ([], 2 / 3, True)
    (message,) = env_errors(tiny_model, *sky, "env.args={env_id = 'no_such_module:Env'}")
    assert message.startswith("env.args.env_id = 'no_such_module:Env' is not a skyrl-gym id; registered: aime")
