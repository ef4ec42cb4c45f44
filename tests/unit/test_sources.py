"""Prompt sources: formats, chat template, skipped rows with their numbers, looping and shuffling."""

from __future__ import annotations

import json

import pytest

from streamrl.engine.config import DataConfig
from streamrl.rollout.sources import PromptSource, PromptSourceError, prompt_text, scan


@pytest.fixture(scope="module")
def tokenizer():
    from streamrl.engine.models import make_tokenizer

    return make_tokenizer(seed=0)


def _jsonl(tmp_path, lines: list[str]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _cfg(path: str, **kw) -> DataConfig:
    return DataConfig(path=path, **{"loop": False, "shuffle": False, **kw})


def test_jsonl_skips_malformed_rows_with_their_numbers(tmp_path, tokenizer):
    path = _jsonl(
        tmp_path,
        [
            json.dumps({"prompt": "alpha beta", "answer": "a"}),
            "{not json",
            json.dumps({"question": "no prompt column"}),
            json.dumps([1, 2]),
            json.dumps({"prompt": "red cat", "answer": "b"}),
        ],
    )
    source = PromptSource(_cfg(path), tokenizer)
    prompts = list(source)
    assert [p.row_number for p in prompts] == [0, 4]
    assert prompts[0].prompt_ids == tokenizer.encode("alpha beta", add_special_tokens=False)
    assert prompts[1].row == {"prompt": "red cat", "answer": "b"}
    assert source.skipped_malformed == 3
    assert [n for n, _ in source.malformed_rows] == [1, 2, 3]
    assert "prompt" in source.malformed_rows[1][1]  # the reason names the missing column
    assert source.skipped_overlong == 0


def test_overlong_prompts_are_skipped_and_counted(tmp_path, tokenizer):
    long_text = " ".join(["alpha beta gamma delta"] * 20)
    assert len(tokenizer.encode(long_text)) > 8
    path = _jsonl(tmp_path, [json.dumps({"prompt": "cat"}), json.dumps({"prompt": long_text})])
    source = PromptSource(_cfg(path, max_prompt_tokens=8), tokenizer)
    assert [p.row_number for p in source] == [0]
    assert source.skipped_overlong == 1 and source.skipped_malformed == 0


def test_chat_messages_use_the_chat_template(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "two + two"}]
    path = _jsonl(tmp_path, [json.dumps({"messages": messages}), json.dumps({"messages": "not a list"})])
    source = PromptSource(_cfg(path), tokenizer)
    (prompt,) = list(source)
    expected = "<|im_start|>user\ntwo + two<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(prompt.prompt_ids) == expected
    assert prompt_text(prompt, source.cfg) == "two + two"
    assert source.malformed_rows[0][0] == 1


def test_parquet_and_saved_dataset(tmp_path, tokenizer):
    import datasets

    rows = [{"prompt": f"{i} + {i} =", "answer": str(2 * i)} for i in range(5)]
    data = datasets.Dataset.from_list(rows)
    data.to_parquet(str(tmp_path / "p.parquet"))
    datasets.DatasetDict({"train": data}).save_to_disk(str(tmp_path / "ds"))
    for path in (tmp_path / "p.parquet", tmp_path / "ds"):
        got = list(PromptSource(_cfg(str(path)), tokenizer))
        assert [p.row["answer"] for p in got] == ["0", "2", "4", "6", "8"]
        assert tokenizer.decode(got[3].prompt_ids) == "3 + 3 ="


def test_loop_and_shuffle_are_seeded(tmp_path, tokenizer):
    path = _jsonl(tmp_path, [json.dumps({"prompt": w}) for w in ("cat", "dog", "sun", "moon", "star")] + ["bad"])
    source = PromptSource(_cfg(path, loop=True, shuffle=True), tokenizer, seed=3)
    it = iter(source)
    first, second = [next(it).row_number for _ in range(5)], [next(it).row_number for _ in range(5)]
    assert sorted(first) == sorted(second) == [0, 1, 2, 3, 4]
    assert first != second  # a new order each epoch (seeded)
    again = iter(PromptSource(_cfg(path, loop=True, shuffle=True), tokenizer, seed=3))
    assert [next(again).row_number for _ in range(5)] == first
    assert source.skipped_malformed == 1  # counted once, not once per epoch


def test_a_source_without_a_usable_row_raises_with_a_summary(tmp_path, tokenizer):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(PromptSourceError, match=r"0 of 0 rows usable; fix: the source has no rows"):
        list(PromptSource(_cfg(str(tmp_path / "empty.jsonl")), tokenizer))
    looping = PromptSource(_cfg(_jsonl(tmp_path, ["{bad"]), loop=True), tokenizer)
    with pytest.raises(
        PromptSourceError,
        match=r"0 of 1 rows usable; 1 malformed \(row 0: not JSON.*fix: no row could be read as an object",
    ):
        list(looping)  # a looping source with nothing usable fails instead of spinning or ending quietly


def test_wrong_prompt_column_summary_names_rows_and_columns(tmp_path, tokenizer, caplog):
    rows = [json.dumps({"question": f"q{i}", "answer": "a"}) for i in range(8)]
    path = _jsonl(tmp_path, rows)
    with caplog.at_level("WARNING", "streamrl.rollout.sources"), pytest.raises(PromptSourceError) as error:
        list(PromptSource(_cfg(path, loop=True, shuffle=True), tokenizer))
    message = str(error.value)  # shuffled, yet the first row numbers come in order
    assert f"data.path = {path}: 0 of 8 rows usable; 8 malformed (rows 0, 1, 2, 3, 4, ...: no non-empty" in message
    assert "column 'prompt' and no 'messages' list (columns: ['answer', 'question']))" in message
    assert "fix: set data.prompt_column (text) or data.messages_column (chat)" in message
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 5  # then only the summary


def test_scan_tallies_rows_as_a_node_would(tmp_path, tokenizer):
    long_text = " ".join(["alpha beta gamma delta"] * 20)
    lines = [json.dumps({"prompt": "cat", "answer": "1"}), "{bad", json.dumps({"prompt": long_text, "answer": "2"})]
    tally = scan(_cfg(_jsonl(tmp_path, lines), max_prompt_tokens=8), tokenizer)
    assert (tally.rows, tally.usable, tally.overlong, [n for n, _ in tally.malformed]) == (3, 1, 1, [1])
    assert tally.columns == ["answer", "prompt"]
    assert tally.summary().endswith(
        "1 of 3 rows usable; 1 malformed (row 1: not JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))); 1 longer than data.max_prompt_tokens = 8 tokens"
    )
    assert (
        scan(_cfg(_jsonl(tmp_path, lines)), tokenizer, limit=1).summary().endswith("1 of the first 1 of 3 rows usable")
    )


def test_demo_rows_when_no_path(tokenizer):
    source = PromptSource(DataConfig(path="", loop=False), tokenizer)
    prompts = list(source)
    assert len(prompts) > 0 and all(p.row["answer"] == "a" for p in prompts)


def test_bad_paths_name_the_fix(tmp_path, tokenizer):
    with pytest.raises(PromptSourceError, match="does not exist"):
        PromptSource(_cfg(str(tmp_path / "missing.jsonl")), tokenizer)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(PromptSourceError, match=r"\.jsonl, \.parquet"):
        PromptSource(_cfg(str(tmp_path / "x.csv")), tokenizer)
