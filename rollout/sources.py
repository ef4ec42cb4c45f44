"""Prompt sources: jsonl, parquet or a saved HF dataset folder (or the built-in demo task), as token ids.

A row becomes a prompt through the tokenizer's chat template when it has a messages column
(a list of {"role", "content"}), else from its prompt column (plain text, no special tokens
added). Rows that cannot become a prompt are skipped and counted, and so are prompts longer than
`data.max_prompt_tokens`, in a `RowTally` whose one-line summary (usable rows, the first bad row
numbers by reason, the columns the rows have) is logged after the first epoch. Row numbers are 0-based
positions in the file (jsonl: the line index). Counts cover each row once, however many epochs a
looping source runs. `scan` judges the rows the same way without a node (the preflight uses it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import random
from collections.abc import Iterator

import msgspec

from streamrl.engine.config import DataConfig
from streamrl.rollout import long_tail

log = logging.getLogger(__name__)

DEMO_ROWS = 256


class PromptSourceError(Exception):
    """A prompt source that cannot be read at all; the message names the path and the fix."""


class Prompt(msgspec.Struct):
    prompt_ids: list[int]
    row: dict  # the dataset row (its columns go to the rewards)
    row_number: int
    max_tokens: int = 0  # the row's own cap on completion tokens (its `max_tokens` column); 0: none

    def cap(self, run_max_tokens: int) -> int:
        """Completion tokens this prompt's group may generate: the row's cap, never above the run's."""
        return min(self.max_tokens, run_max_tokens) if self.max_tokens else run_max_tokens


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
    """Every row of a .jsonl, .parquet or saved-dataset folder (undecodable jsonl lines as markers), of
    a reasoning-gym task (`reasoning_gym:NAME[:SIZE[:SEED]]`), of a verifiers taskset (`verifiers:ID`) or of the
    long-tailed lengths task (`lengths:MIN-MAX`, rollout/long_tail.py)."""
    if path.startswith("reasoning_gym:"):
        from streamrl.rollout.envs.reasoning_gym import rows

        try:
            return rows(path)
        except (ImportError, ValueError) as e:
            raise PromptSourceError(str(e)) from None
    if path.startswith(long_tail.PREFIX):
        try:
            return long_tail.rows(path)
        except ValueError as e:
            raise PromptSourceError(str(e)) from None
    if path.startswith("verifiers:"):
        from streamrl.rollout.envs.verifiers_tasks import rows

        try:
            return rows(path)
        except ValueError as e:
            raise PromptSourceError(str(e)) from None
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


@dataclasses.dataclass(kw_only=True)
class RowTally:
    """What a source's rows are worth so far: counts, and the first bad rows grouped by reason."""

    path: str  # data.path, or "<demo>"
    rows: int  # rows in the source
    judged: int = 0
    usable: int = 0
    overlong: int = 0
    malformed: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (row number, why), every one
    columns: list[str] = dataclasses.field(default_factory=list)  # of the first usable row, else the first object row
    max_prompt_tokens: int = 0

    def add(self, row_number: int, row, outcome: str | None) -> None:
        """Count one row: `outcome` None (usable), OVERLONG, or why it is malformed."""
        self.judged += 1
        if isinstance(row, dict) and (not self.columns or (outcome is None and self.usable == 0)):
            self.columns = sorted(row)
        if outcome is None:
            self.usable += 1
        elif outcome == OVERLONG:
            self.overlong += 1
        else:
            self.malformed.append((row_number, outcome))

    def summary(self, shown: int = 5) -> str:
        """One line: how many rows are usable, and why the others are not, with their first row numbers."""
        of = f"of the first {self.judged} of {self.rows}" if self.judged < self.rows else f"of {self.rows}"
        parts = [f"data.path = {self.path}: {self.usable} {of} rows usable"]
        if self.malformed:
            by_reason: dict[str, list[int]] = {}
            for number, why in sorted(self.malformed):  # shuffled epochs judge rows out of order
                by_reason.setdefault(why, []).append(number)
            reasons = [
                f"{'rows' if len(rows) > 1 else 'row'} {', '.join(map(str, rows[:shown]))}"
                f"{', ...' if len(rows) > shown else ''}: {why}"
                for why, rows in list(by_reason.items())[:3]
            ]
            parts.append(f"{len(self.malformed)} malformed ({'; '.join(reasons)})")
        if self.overlong:
            parts.append(f"{self.overlong} longer than data.max_prompt_tokens = {self.max_prompt_tokens} tokens")
        return "; ".join(parts)

    def fix(self) -> str:
        """What to change when no row is usable."""
        if self.rows == 0:
            return "the source has no rows: give a dataset with one prompt per row"
        if self.overlong and not self.malformed:
            return f"raise data.max_prompt_tokens (now {self.max_prompt_tokens}) or shorten the prompts"
        if not self.columns:
            return "no row could be read as an object: fix the rows named above"
        return (
            "set data.prompt_column (text) or data.messages_column (chat) to the column that holds "
            f"the prompt; the rows have columns {self.columns}"
        )


OVERLONG = "overlong"
ROW_CAP_COLUMN = "max_tokens"  # a row's own cap on completion tokens (Prompt.cap)
LOGGED_ROWS = 5  # malformed rows logged one by one; the rest only in the summary


def prompt_ids(row: dict | _Malformed, cfg: DataConfig, tokenizer) -> list[int]:
    """A row's prompt as token ids: chat template over its messages column, else its prompt text.

    Raises ValueError (why the row is malformed) or PromptSourceError (the tokenizer cannot serve chat rows).
    """
    if isinstance(row, _Malformed):
        raise ValueError(row.why)
    messages = row.get(cfg.messages_column)
    if messages is not None:
        return _chat(messages, cfg, tokenizer)
    text = row.get(cfg.prompt_column)
    if not isinstance(text, str) or not text:
        raise ValueError(
            f"no non-empty string in column {cfg.prompt_column!r} and no "
            f"{cfg.messages_column!r} list (columns: {sorted(row)})"
        )
    return list(tokenizer.encode(text, add_special_tokens=False))


def _row_cap(row: dict) -> int:
    """The row's `max_tokens` column (a per-prompt cap on completion tokens), 0 when it has none; ValueError
    (the row is malformed) when it is not a positive integer."""
    cap = row.get(ROW_CAP_COLUMN)
    if cap is None:
        return 0
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"column {ROW_CAP_COLUMN!r} is {cap!r}; give a positive integer (a cap on completion tokens)")
    return cap


def _chat(messages, cfg: DataConfig, tokenizer) -> list[int]:
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise ValueError(f"column {cfg.messages_column!r} is not a non-empty list of {{'role': str, 'content': str}}")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptSourceError(
            f"rows have a {cfg.messages_column!r} column but the tokenizer has no "
            "chat template; set tokenizer.chat_template or use a prompt column"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def judge(row: dict | _Malformed, cfg: DataConfig, tokenizer) -> tuple[list[int] | None, str | None]:
    """(prompt ids, None) for a usable row, else (None, OVERLONG or why it is malformed)."""
    try:
        ids = prompt_ids(row, cfg, tokenizer)
        _row_cap(row)
    except ValueError as e:
        return None, str(e)
    if len(ids) > cfg.max_prompt_tokens:
        return None, OVERLONG
    return ids, None


def _rows(cfg: DataConfig, seed: int) -> list[dict | _Malformed]:
    if cfg.path:
        return read_rows(cfg.path)
    from streamrl.rewards.demo import demo_rows

    return demo_rows(DEMO_ROWS, seed)


def scan(cfg: DataConfig, tokenizer, limit: int | None = None, seed: int = 0) -> RowTally:
    """Judge the source's rows (the first `limit` of them) as a node would, without generating anything."""
    rows = _rows(cfg, seed)
    tally = RowTally(path=cfg.path or "<demo>", rows=len(rows), max_prompt_tokens=cfg.max_prompt_tokens)
    for i, row in enumerate(rows[:limit]):
        tally.add(i, row, judge(row, cfg, tokenizer)[1])
    return tally


class PromptSource:
    """Iterates `Prompt`s per `DataConfig`: shuffled per epoch (seeded), looping or ending when exhausted.

    A source none of whose rows is usable raises `PromptSourceError` with the tally's summary.
    """

    def __init__(self, cfg: DataConfig, tokenizer, seed: int = 0):
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self.rows = _rows(cfg, seed)
        self.tally = RowTally(path=cfg.path or "<demo>", rows=len(self.rows), max_prompt_tokens=cfg.max_prompt_tokens)
        self.epochs = 0
        self._judged: set[int] = set()

    @property
    def skipped_malformed(self) -> int:
        return len(self.tally.malformed)

    @property
    def skipped_overlong(self) -> int:
        return self.tally.overlong

    @property
    def malformed_rows(self) -> list[tuple[int, str]]:
        return self.tally.malformed

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
            if produced == 0:
                raise PromptSourceError(f"no usable prompt: {self.tally.summary()}; fix: {self.tally.fix()}")
            if self.epochs == 1 and self.tally.usable < len(self.rows):
                log.warning("%s", self.tally.summary())
            if not self.cfg.loop:
                return

    def _prompt(self, i: int) -> Prompt | None:
        row = self.rows[i]
        first = i not in self._judged
        self._judged.add(i)
        ids, why = judge(row, self.cfg, self.tokenizer)
        if first:
            self.tally.add(i, row, why)
            if why not in (None, OVERLONG) and len(self.tally.malformed) <= LOGGED_ROWS:
                log.warning("%s row %d skipped: %s", self.tally.path, i, why)
        if ids is None:
            return None
        return Prompt(prompt_ids=ids, row=row, row_number=i, max_tokens=_row_cap(row))


def prompt_text(prompt: Prompt, cfg: DataConfig) -> str:
    """The prompt as text for the rewards (the row's own text; chat messages joined by newlines)."""
    messages = prompt.row.get(cfg.messages_column)
    if isinstance(messages, list):
        return "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return str(prompt.row.get(cfg.prompt_column, ""))
