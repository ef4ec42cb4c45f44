"""`make-tiny-model --for reasoning_gym:TASK` (ops/tiny_model.py): a tiny model taught the task's answer format,
not its answers. What is checked here is what the teaching rests on (the long run is README's test and
bench/RESULTS.md): the tags are one token each, the task's prompts are short in its tokenizer, the teaching
lowers the loss on the format, and a source that is not a reasoning-gym task is refused."""

from __future__ import annotations

import pytest

from streamrl.ops.tiny_model import TAGS, make, make_for


def test_a_tiny_model_made_for_a_task_learns_its_answer_format(tmp_path):
    pytest.importorskip("reasoning_gym")
    from transformers import AutoTokenizer

    folder, said = make_for(tmp_path / "m", "reasoning_gym:syllogism:32", steps=30)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert [len(tokenizer.encode(t, add_special_tokens=False)) for t in TAGS] == [1, 1]
    reply = "<answer>Yes</answer>"
    assert tokenizer.decode(tokenizer.encode(reply, add_special_tokens=False)) == reply
    assert said.startswith("taught to reply <answer>X</answer> to reasoning_gym:syllogism:32's prompts, X drawn at ")
    assert "(2 of the task's, 8 distractors): 30 steps" in said
    final = float(said.rsplit(" ", 1)[1])
    assert final < 1.5  # from ~6.2 (a random model over ~600 tokens); the floor is about log(10) / 4 = 0.58


def test_only_a_reasoning_gym_task_and_a_known_shape(tmp_path):
    with pytest.raises(ValueError, match=r"--for data.jsonl: give a reasoning-gym task, reasoning_gym:NAME"):
        make_for(tmp_path / "m", "data.jsonl")
    with pytest.raises(ValueError, match=r"--shape 'huge': choose one of tiny,"):
        make(tmp_path / "m", 0, "huge", "float32", "cpu")
