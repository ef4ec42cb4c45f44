"""`streamrl eval` on bad input: exit 2 with one line naming the problem, before any engine loads."""

from __future__ import annotations

import pytest

from streamrl.ops.eval import _name, main


@pytest.mark.parametrize(
    ("target", "data", "sets", "said"),
    [
        ("{tmp}/nothing", ["held.jsonl"], [], "does not exist: give a model folder"),
        ("{tmp}", ["held.jsonl"], [], "is no model folder (no config.json)"),
        ("{model}", [], [], "nothing to evaluate on: give --data PATH"),
        ("{model}", ["{tmp}/gone.jsonl"], ["rollout.backend='hf'"], "gone.jsonl does not exist"),
        ("{model}", ["demo:heldout"], ["eval.functions=['no_such_reward']"], "no_such_reward"),
        ("{model}", ["demo:heldout"], ["eval.n=0"], "eval.n"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_model, tmp_path, capsys, target, data, sets, said):
    fill = {"tmp": str(tmp_path), "model": tiny_model}
    code = main(target.format(**fill), str(tmp_path / "out"), None, sets, [d.format(**fill) for d in data])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err and said in err, err


def test_source_names():
    assert _name("data/gsm8k_test.jsonl") == "gsm8k_test"
    assert _name("reasoning_gym:leg_counting:100:7") == "leg_counting" and _name("demo:heldout") == "demo-heldout"
