"""A launch's closing line counts its own steps (ops/closing.py): a resumed run says where it resumed and names what
earlier launches wrote apart, including the steps a learner that died past its last checkpoint wrote and the
resume trained again (issue 52: '22 steps' for an 11-step resume)."""

from __future__ import annotations

import json

from streamrl.ops.closing import closing_line


def _write(run_dir, steps_and_times):
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step, t in steps_and_times:
            f.write(json.dumps({"step": step, "time": t, "reward/mean": 0.5, "completion_tokens": 10,
                                "time/train_s": 1.0}) + "\n")  # fmt: skip


def test_a_fresh_run_counts_every_step(tmp_path):
    _write(tmp_path, [(1, 100.0), (2, 101.0)])
    line = closing_line(tmp_path, since=50.0, wall_s=10.0, resumed=False)
    # 2 steps x 10 tokens / (2 x 1.0 s) = 10 tokens/s
    assert line.startswith("2 steps in 10 s; mean reward 0.500") and "trained 10 tokens/s" in line
    assert "resumed" not in line and "earlier" not in line


def test_a_resume_counts_only_its_own_steps_and_names_the_earlier_ones(tmp_path):
    # the first learner wrote steps 1-13 and died; its last checkpoint was step 10; the resume wrote 11-20
    _write(tmp_path, [(s, 100.0 + s) for s in range(1, 14)] + [(s, 200.0 + s) for s in range(11, 21)])
    line = closing_line(tmp_path, since=200.0, wall_s=30.0, resumed=True)
    assert line.startswith("resumed at step 10; 10 steps since, in 30 s; ")
    assert line.endswith("; earlier launches wrote 13 steps (the last: step 13)")


def test_a_resume_that_wrote_no_step_says_so(tmp_path):
    _write(tmp_path, [(1, 100.0)])
    line = closing_line(tmp_path, since=200.0, wall_s=5.0, resumed=True)
    assert line == "resumed; no step finished in 5 s; earlier launches wrote 1 steps (the last: step 1)"
