"""Call one reward function on a batch, turning failures into `None` per sample.

Rewards are called as TRL's GRPOTrainer calls them: by keyword, `fn(prompts=..., completions=...,
completion_ids=..., **columns)`, every dataset column a list with one value per sample; so a reward
written as TRL documents it (`def reward(completions, **kwargs)`) runs unchanged. Where it differs
from TRL: prompts and completions are always text (TRL passes message lists for chat datasets), and
TRL's `trainer_state`, `log_extra`, `log_metric` and `environments` keywords are not passed.

The contract (README "Reward functions"): a reward returns a list with one float (or None, to abstain)
per completion, in order. The same code runs inline and inside pool workers.
- A batch call that raises is retried one sample at a time, so one bad sample costs only its own
  reward; the outcome says it fell back (the scorer says so once on the console).
- A call that breaks the contract (a list of the wrong length, a value that is not a number) is an
  error of the reward, `RewardValueError`, for every sample of the batch, and never retried: a batch of
  one passes the length check that `[mean]` fails, so a retry made a batch statistic a per-sample score.
- A non-finite value (NaN would poison the advantages) fails its own sample only.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec


class Batch(msgspec.Struct, kw_only=True):
    """The samples one reward call sees; `columns` are TRL-style lists, one value per sample."""

    prompts: list[str]
    completions: list[str]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.completions)

    def take(self, start: int, stop: int) -> Batch:
        return Batch(
            prompts=self.prompts[start:stop],
            completions=self.completions[start:stop],
            completion_ids=self.completion_ids[start:stop],
            columns={k: v[start:stop] for k, v in self.columns.items()},
        )


class CallOutcome(msgspec.Struct, kw_only=True):
    values: list[float | None]
    errors: int = 0
    timeouts: int = 0
    traceback: str = ""
    fell_back: bool = False  # the batch call raised and each sample was scored alone


class RewardValueError(ValueError):
    """A reward broke the contract: not one number (or None) per sample. The message names the function,
    what it returned against what it was given, and the fix."""


CONTRACT = "a reward returns a list with one float (or None) per completion, in the order given"


# The keywords every reward receives besides the dataset columns, as TRL passes them.
CALL_KEYWORDS = ("prompts", "completions", "completion_ids")
# As in TRL, a row's prompt and completion columns are not passed as columns (the call carries them).
NOT_COLUMNS = frozenset({"prompt", "completion", *CALL_KEYWORDS})


def column_names(row_keys, answer_column: str = "answer") -> list[str]:
    """The column keywords a reward receives for rows with keys `row_keys` (see `rows_to_columns`)."""
    names = [k for k in row_keys if k not in NOT_COLUMNS]
    if answer_column != "answer" and answer_column in names and "answer" not in names:
        names.append("answer")
    return names


def rows_to_columns(columns: list[dict], n: int, answer_column: str = "answer") -> dict[str, list[Any]]:
    """`[{"answer": "a"}, {"answer": "b"}]` -> `{"answer": ["a", "b"]}`; every row must have the same keys.

    The prompt/completion columns are left out (as TRL does); `answer_column` is also passed as
    `answer`, the name the built-in rewards read, when the rows have no `answer` of their own.
    """
    if len(columns) != n:
        raise ValueError(f"score(): {len(columns)} column rows for {n} completions; give one row per sample")
    keys = [k for k in (columns[0] if columns else ()) if k not in NOT_COLUMNS]
    for i, row in enumerate(columns):
        if set(row) - NOT_COLUMNS != set(keys):
            raise ValueError(
                f"score(): columns[{i}] has keys {sorted(row)} but columns[0] has "
                f"{sorted(columns[0])}; every row must carry the same columns"
            )
    out = {k: [row[k] for row in columns] for k in keys}
    if answer_column != "answer" and answer_column in out and "answer" not in out:
        out["answer"] = out[answer_column]
    return out


def _run_awaitable(awaitable) -> Any:
    async def wait():
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    box: dict[str, Any] = {}  # called from inside a running loop: give the coroutine a loop of its own

    def target():
        try:
            box["value"] = asyncio.run(wait())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name="reward-async")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def function_name(fn: Callable[..., Any]) -> str:
    """What a message calls a reward: its qualified name (a callable object's class)."""
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def invoke(fn: Callable[..., Any], batch: Batch) -> list[float | None]:
    """Call `fn` by keyword as TRL does (sync or async); `RewardValueError` unless it returned one number or None
    per sample. A non-finite number is returned as it is (`finite` judges it, per sample)."""
    result = fn(
        prompts=batch.prompts, completions=batch.completions, completion_ids=batch.completion_ids, **batch.columns
    )
    if inspect.isawaitable(result):
        result = _run_awaitable(result)
    name = function_name(fn)
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__iter__"):
        raise RewardValueError(f"reward {name} returned {type(result).__name__}, not a list; {CONTRACT}")
    values = list(result)
    if len(values) != len(batch):
        raise RewardValueError(
            f"reward {name} returned {len(values)} values for {len(batch)} completions; {CONTRACT} (a score of the "
            "whole batch, such as its mean, is given to each: `[score] * len(completions)`)"
        )
    return [_as_float(v, name, i) for i, v in enumerate(values)]


def _as_float(value: Any, name: str, i: int) -> float | None:
    if value is None:
        return None
    if not isinstance(value, bool) and not isinstance(value, numbers.Real) and hasattr(value, "item"):
        value = value.item()  # numpy / torch scalars
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardValueError(
            f"reward {name} returned {value!r} ({type(value).__name__}) for completion {i}, not a number; "
            f"{CONTRACT} (e.g. `float(x)`)"
        )
    return float(value)


def finite(values: list[float | None], name: str) -> CallOutcome:
    """`values` with each non-finite one made None and counted as an error of its own sample."""
    bad = [i for i, v in enumerate(values) if v is not None and not math.isfinite(v)]
    if not bad:
        return CallOutcome(values=values)
    first = f"reward {name} returned {values[bad[0]]} for completion {bad[0]}, not a finite number"
    out = [None if i in bad else v for i, v in enumerate(values)]
    return CallOutcome(values=out, errors=len(bad), traceback=f"{__name__}.RewardValueError: {first}")


def safe_call(fn: Callable[..., Any], batch: Batch) -> CallOutcome:
    """`invoke`, with a batch that raises retried sample by sample; failures become None and are counted.
    A broken contract fails the whole batch (module doc)."""
    name = function_name(fn)
    try:
        return finite(invoke(fn, batch), name)
    except RewardValueError:
        return CallOutcome(values=[None] * len(batch), errors=len(batch), traceback=traceback.format_exc())
    except Exception:
        first = traceback.format_exc()
    if len(batch) == 1:
        return CallOutcome(values=[None], errors=1, traceback=first)
    values: list[float | None] = []
    errors = 0
    for i in range(len(batch)):
        try:
            one = finite(invoke(fn, batch.take(i, i + 1)), name)
        except Exception:
            one = CallOutcome(values=[None], errors=1)
        values += one.values
        errors += one.errors
    # errors may be 0 here (the batch call broke, each sample alone did not): the values stand,
    # and the traceback is still reported so the batch failure is seen once.
    return CallOutcome(values=values, errors=errors, traceback=first, fell_back=True)
