"""Prompt sources: jsonl, parquet or a saved HF dataset folder (or the built-in demo task), as token ids.

A row becomes a prompt through the tokenizer's chat template when it has a messages column
(a list of {"role", "content"}), else from its prompt column (plain text, no special tokens
added). Rows that cannot become a prompt are skipped and counted (`skipped_malformed`, row
numbers in `malformed_rows`); prompts longer than `data.max_prompt_tokens` are skipped and counted
(`skipped_overlong`). Row numbers are 0-based positions in the file (jsonl: the line index).
Counts cover each row once, however many epochs a looping source runs.
"""

from __future__ import annotations

import json
import logging
import pathlib
import random
from collections.abc import Iterator

import msgspec

from streamrl.engine.config import DataConfig

log = logging.getLogger(__name__)

DEMO_ROWS = 256


class PromptSourceError(Exception):
    """A prompt source that cannot be read at all; the message names the path and the fix."""


class Prompt(msgspec.Struct):
    prompt_ids: list[int]
    row: dict  # the dataset row (its columns go to the rewards)
    row_number: int


class _Malformed(msgspec.Struct):
    why: str


def _read_jsonl(path: pathlib.Path) -> list[dict | _Malformed]:
    rows: list[dict | _Malformed] = []
    with path.open("rb") as f:
        for line in f:
            if not line.strip():
                rows.append(_Malformed("empty line"))
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                rows.append(_Malformed(f"not JSON ({e})"))
                continue
            rows.append(row if isinstance(row, dict) else _Malformed(f"a JSON {type(row).__name__}, not an object"))
    return rows


def _read_parquet(path: pathlib.Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _read_dataset(path: pathlib.Path) -> list[dict]:
    import datasets

    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise PromptSourceError(
                f"data.path = {path} holds splits {sorted(data)} and no 'train'; "
                f"save the split to use with dataset['<split>'].save_to_disk(...)"
            )
        data = data["train"]
    return data.to_list()


def read_rows(path: str) -> list[dict | _Malformed]:
    """Every row of a .jsonl, .parquet or saved-dataset folder (undecodable jsonl lines as markers)."""
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise PromptSourceError(
            f"data.path = {path} does not exist; give a .jsonl, .parquet or a folder "
            "written by Dataset.save_to_disk (or leave it empty for the demo task)"
        )
    if p.is_dir():
        return _read_dataset(p)
    if p.suffix == ".jsonl":
        return _read_jsonl(p)
    if p.suffix == ".parquet":
        return _read_parquet(p)
    raise PromptSourceError(
        f"data.path = {path}: unknown format {p.suffix!r}; use .jsonl, .parquet or a "
        "folder written by Dataset.save_to_disk"
    )


class PromptSource:
    """Iterates `Prompt`s per `DataConfig`: shuffled per epoch (seeded), looping or ending when exhausted."""

    def __init__(self, cfg: DataConfig, tokenizer, seed: int = 0):
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        if cfg.path:
            self.rows = read_rows(cfg.path)
        else:
            from streamrl.rewards.demo import demo_rows

            self.rows = demo_rows(DEMO_ROWS, seed)
        self.skipped_overlong = 0
        self.skipped_malformed = 0
        self.malformed_rows: list[tuple[int, str]] = []
        self.epochs = 0
        self._judged: set[int] = set()

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            produced = 0
            order = list(range(len(self.rows)))
            if self.cfg.shuffle:
                random.Random(self.seed * 1_000_003 + self.epochs).shuffle(order)
            for i in order:
                prompt = self._prompt(i)
                if prompt is not None:
                    produced += 1
                    yield prompt
            self.epochs += 1
            if not self.cfg.loop or produced == 0:
                if produced == 0:
                    log.warning(
                        "prompt source %s has no usable prompt (%d rows, %d malformed, %d overlong)",
                        self.cfg.path or "<demo>",
                        len(self.rows),
                        self.skipped_malformed,
                        self.skipped_overlong,
                    )
                return

    def _prompt(self, i: int) -> Prompt | None:
        row = self.rows[i]
        first = i not in self._judged
        self._judged.add(i)
        try:
            ids = self._tokenize(row)
        except ValueError as e:
            if first:
                self.skipped_malformed += 1
                self.malformed_rows.append((i, str(e)))
                log.warning("%s row %d skipped: %s", self.cfg.path or "<demo>", i, e)
            return None
        if len(ids) > self.cfg.max_prompt_tokens:
            if first:
                self.skipped_overlong += 1
                log.info(
                    "row %d skipped: %d prompt tokens > data.max_prompt_tokens = %d",
                    i,
                    len(ids),
                    self.cfg.max_prompt_tokens,
                )
            return None
        return Prompt(prompt_ids=ids, row=row, row_number=i)

    def _tokenize(self, row: dict | _Malformed) -> list[int]:
        if isinstance(row, _Malformed):
            raise ValueError(row.why)
        messages = row.get(self.cfg.messages_column)
        if messages is not None:
            return self._chat(messages)
        text = row.get(self.cfg.prompt_column)
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"no non-empty string in column {self.cfg.prompt_column!r} and no "
                f"{self.cfg.messages_column!r} list (columns: {sorted(row)})"
            )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _chat(self, messages) -> list[int]:
        ok = (
            isinstance(messages, list)
            and messages
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        )
        if not ok:
            raise ValueError(
                f"column {self.cfg.messages_column!r} is not a non-empty list of {{'role': str, 'content': str}}"
            )
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptSourceError(
                f"rows have a {self.cfg.messages_column!r} column but the tokenizer has no "
                "chat template; set tokenizer.chat_template or use a prompt column"
            )
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def prompt_text(prompt: Prompt, cfg: DataConfig) -> str:
    """The prompt as text for the rewards (the row's own text; chat messages joined by newlines)."""
    messages = prompt.row.get(cfg.messages_column)
    if isinstance(messages, list):
        return "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return str(prompt.row.get(cfg.prompt_column, ""))
