"""Environment libraries a data source names, and the settings each one implies.

`streamrl run --data SOURCE` works with no `--set` for these sources; what the source implies fills only
the fields the config (TOML and `--set`) does not give, so an explicit setting always wins:

- `reasoning_gym:NAME[:SIZE[:SEED]]`: reward.functions = the task's own `score_answer` (reasoning_gym.py);
- `verifiers:TASKSET_ID`: reward.functions = the tasks' `@vf.reward` functions (verifiers_tasks.py);
- rows with `env_class` and a chat `prompt` (SkyRL's format): `env.name = "skyrl_gym"` (the reward is the
  environment's, skyrl.py) and `data.messages_column = "prompt"`.

For each, `data.max_prompt_tokens` (when not given) becomes the longest prompt of the source, if that is
above the default, and `model.max_model_len` (when not given) makes room for it and a completion: a
library's prompts are its own, so refusing them as overlong would only stop the run.
`implied(data, cfg)` returns the overrides and one line saying what was filled; the commands apply
them when the config is loaded, so `streamrl run`, its learner and its nodes agree.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from streamrl.engine.config import Config
from streamrl.engine.config.presets import completion_limit

SCAN_ROWS = 10_000  # rows tokenized at most to find the longest prompt (as preflight judges them)
SCORERS = {
    "reasoning_gym": "streamrl.rollout.envs.reasoning_gym:score",
    "verifiers": "streamrl.rollout.envs.verifiers_tasks:score",
}


def library(cfg: Config) -> str:
    """Which library `data.path` names or holds rows of: reasoning_gym, verifiers, skyrl_gym, or ''."""
    path = cfg.data.path
    for name in SCORERS:
        if path.startswith(f"{name}:"):
            return name
    row = _first_row(path)
    if isinstance(row, dict) and isinstance(row.get("env_class"), str) and isinstance(row.get("prompt"), list):
        return "skyrl_gym"
    return ""


def _first_row(path: str) -> Any:
    """The source's first row, read cheaply (None when there is none or it cannot be read: preflight says why)."""
    p = pathlib.Path(path).expanduser()
    try:
        if p.suffix == ".jsonl" and p.is_file():
            with p.open("rb") as f:
                return json.loads(f.readline() or b"null")
        if p.suffix == ".parquet" and p.is_file():
            import pyarrow.parquet as pq

            batch = next(pq.ParquetFile(p).iter_batches(batch_size=1), None)
            return batch.to_pylist()[0] if batch is not None and batch.num_rows else None
    except (OSError, ValueError, ImportError):
        return None
    return None


def _given(data: dict, dotted: str) -> bool:
    section, field = dotted.split(".")
    return isinstance(data.get(section), dict) and field in data[section]


def implied(data: dict, cfg: Config) -> tuple[list[str], str]:
    """(`section.field=value` overrides, one line naming them) for what `cfg.data.path` implies and `data`
    (the raw config, overrides applied) does not give; ([], '') for any other source. The built-in demo implies
    its held-out evaluation (rollout/evaluation_prompts.demo_implied)."""
    if not cfg.data.path:
        from streamrl.rollout.evaluation_prompts import demo_implied

        return demo_implied(data, cfg)
    name = library(cfg)
    if not name:
        return [], ""
    fill: dict[str, Any] = {}
    if name in SCORERS:
        fill["reward.functions"] = [SCORERS[name]]
    else:
        fill["env.name"], fill["data.messages_column"] = "skyrl_gym", "prompt"
    fill = {k: v for k, v in fill.items() if not _given(data, k)}
    if not _given(data, "data.max_prompt_tokens"):
        longest = _longest_prompt(cfg, fill.get("data.messages_column", cfg.data.messages_column))
        if longest > cfg.data.max_prompt_tokens:
            fill["data.max_prompt_tokens"] = longest
        room = longest + completion_limit(cfg)
        if room > cfg.model.max_model_len and not _given(data, "model.max_model_len"):
            fill["model.max_model_len"] = room
    if not fill:
        return [], ""
    overrides = [f"{k}={json.dumps(v)}" for k, v in fill.items()]
    said = ", ".join(f"{k} = {v!r}" for k, v in fill.items())
    return overrides, f"data.path = {cfg.data.path} is a {name} source: {said} (set any of them to change it)"


def _longest_prompt(cfg: Config, messages_column: str) -> int:
    """Tokens of the source's longest prompt as the node renders it (0 when the rows or the tokenizer
    cannot be read: preflight reports that)."""
    import msgspec

    from streamrl.engine.models import default_tiny_model, load_tokenizer
    from streamrl.rollout.sources import prompt_ids, read_rows

    try:
        tokenizer = load_tokenizer(cfg.model.path or str(default_tiny_model()), cfg.model.trust_remote_code)
        rows = read_rows(cfg.data.path)[:SCAN_ROWS]
    except Exception:  # noqa: BLE001 - the model and data checks name the problem in their own words
        return 0
    data = msgspec.structs.replace(cfg.data, messages_column=messages_column)
    longest = 0
    for row in rows:
        try:
            longest = max(longest, len(prompt_ids(row, data, tokenizer)))
        except Exception:  # noqa: BLE001 - a malformed row is counted by the data check
            continue
    return longest
