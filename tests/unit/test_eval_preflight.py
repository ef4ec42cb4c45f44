"""[eval] in preflight: an unreadable source, an unknown reward and a source without prompts are errors named
in one line; a source that repeats training prompts is warned about; the demo's held-out prompts are not
training prompts. Also the prompts an evaluation asks for (rollout/evaluation_prompts.py)."""

from __future__ import annotations

import json

from streamrl.engine.config import build
from streamrl.engine.models import load_tokenizer
from streamrl.ops import preflight as pf
from streamrl.rewards.demo import demo_rows
from streamrl.rollout.evaluation_prompts import eval_prompts, heldout_rows


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _eval(tiny_model, *sets: str) -> list[pf.Problem]:
    cfg = build({}, [f"model.path={tiny_model!r}", "run.device='cpu'", *sets])
    return [p for p in pf.preflight(cfg, ["rollout"]).problems if p.check == "eval"]


def test_demo_heldout_passes_and_is_held_out(tiny_model):
    found = _eval(tiny_model, "eval.sources=[{name='demo-heldout', path='demo:heldout'}]")
    assert [(p.level, p.message) for p in found] == [("info", "eval source 'demo-heldout': 32 prompts x 1 samples")]
    training = {r["prompt"] for seed in range(50) for r in demo_rows(256, seed)}
    assert not training & {r["prompt"] for r in heldout_rows()}  # 9-10 words; training rows have 3-8


def test_mistakes_are_named(tiny_model, tmp_path):
    good = _jsonl(tmp_path / "held.jsonl", [{"prompt": "one two", "answer": "a"}])
    empty = _jsonl(tmp_path / "empty.jsonl", [{"question": "x"}])
    found = _eval(
        tiny_model,
        f"eval.sources=[{{name='gone', path='{tmp_path}/gone.jsonl'}}, {{name='empty', path='{empty}'}}, "
        f"{{name='held', path='{good}'}}]",
        "eval.functions=['no_such_reward']",
    )
    errors = [p.message for p in found if p.level == "error"]
    assert len(errors) == 3, errors
    assert "gone.jsonl does not exist" in errors[0]
    assert "eval source 'empty'" in errors[1] and "no usable prompt of 1 rows" in errors[1]
    assert "eval source 'held'" in errors[2] and "no_such_reward" in errors[2]
    assert all("\n" not in m for m in errors)


def test_training_prompts_in_a_source_are_warned(tiny_model, tmp_path):
    rows = [{"prompt": f"{i} plus {i}", "answer": "a"} for i in range(10)]
    train = _jsonl(tmp_path / "train.jsonl", rows)
    held = _jsonl(tmp_path / "held.jsonl", rows[7:] + [{"prompt": "new one", "answer": "a"}])
    found = _eval(tiny_model, f"data.path={train!r}", f"eval.sources=[{{name='held', path='{held}'}}]")
    assert [p.level for p in found] == ["warning"]
    assert "3 of its 4 prompts are training prompts too" in found[0].message
    clean = _jsonl(tmp_path / "clean.jsonl", [{"prompt": "new one", "answer": "a"}])  # the positive control
    found = _eval(tiny_model, f"data.path={train!r}", f"eval.sources=[{{name='held', path='{clean}'}}]")
    assert [p.level for p in found] == ["info"]


def test_prompts_are_the_first_usable_rows_in_file_order(tiny_model, tmp_path):
    rows = [{"prompt": "a b"}, {"question": "no prompt"}, {"prompt": "c d"}, {"prompt": "e f"}]
    path = _jsonl(tmp_path / "held.jsonl", rows)
    cfg = build({}, [f"eval.sources=[{{name='held', path='{path}'}}]", "eval.max_prompts=2"])
    prompts = eval_prompts(cfg.eval.sources[0], cfg, load_tokenizer(tiny_model))
    assert [p.row_number for p in prompts] == [0, 2]  # row 1 has no prompt; max_prompts stops at 2


def test_an_env_run_evaluates_episodes_its_environment_rewards(tiny_model):
    """With [env], [eval] is accepted and no reward function is checked (the environment rewards the episodes);
    a source that cannot be read is still an error."""
    env = ["env.name='echo_target'", "eval.n=2", "eval.functions=['no_such_reward']"]
    found = _eval(tiny_model, *env, "eval.sources=[{name='held', path='demo:heldout'}]")
    assert [(p.level, p.message) for p in found] == [("info", "eval source 'held': 32 prompts x 2 episodes")]
    found = _eval(tiny_model, *env, "eval.sources=[{name='gone', path='gone.jsonl'}]")
    assert [p.level for p in found] == ["error"] and "gone.jsonl does not exist" in found[0].message
