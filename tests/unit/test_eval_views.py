"""What a person sees of evaluations: the live view's row per source and the closing summary's first -> last,
read from the step records that carry them; an incomplete evaluation shows its coverage, never a figure."""

from streamrl.learner.evaluation.report import first_to_last
from streamrl.ops.eval_status import eval_rows

KEY = "eval/demo-heldout/"


def _records(last_complete: bool) -> list[dict]:
    last = {KEY + "complete": 1.0, KEY + "pass@1": 0.97, KEY + "version": 3.0}
    if not last_complete:
        last = {KEY + "complete": 0.0, KEY + "prompts_done": 3.0, KEY + "prompts_asked": 32.0, KEY + "version": 3.0}
    first = {KEY + "complete": 1.0, KEY + "pass@1": 0.0625, KEY + "version": 0.0}
    return [{"step": 1, "reward/mean": 0.1, **first}, {"step": 2, "reward/mean": 0.2}, {"step": 3, **last}]


def test_first_to_last_and_the_live_row():
    assert first_to_last(_records(True)) == ["eval demo-heldout: pass@1 0.06 → 0.97 (v0 → v3)"]
    assert eval_rows(_records(True)) == [("eval demo-heldout", "v3 pass@1 0.970; first v0 pass@1 0.062")]
    assert eval_rows(_records(True)[:2]) == [("eval demo-heldout", "v0 pass@1 0.062")]  # one evaluation so far


def test_an_incomplete_evaluation_shows_its_coverage():
    assert first_to_last(_records(False)) == ["eval demo-heldout: pass@1 0.06 → incomplete (3/32) (v0 → v3)"]
    assert eval_rows(_records(False))[0][1] == "v3 incomplete (3/32 prompts); first v0 pass@1 0.062"
    assert first_to_last([{"step": 1, "reward/mean": 0.5}]) == [] and eval_rows([{"step": 1}]) == []
