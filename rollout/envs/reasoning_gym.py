"""reasoning-gym tasks (procedural, offline) as prompt rows, scored by the task's own `score_answer`.

- `rows("reasoning_gym:NAME[:SIZE[:SEED]]")`: the rows of one task, each
  `{"messages": [system, user], "prompt", "answer", "rg_task": [NAME, SIZE, SEED, INDEX]}`; the
  system prompt is reasoning-gym's default (answer inside `<answer>...</answer>`). `streamrl
  reasoning-gym NAME --size N --out rows.jsonl` writes them for `data.path` (`write_rows`).
- `score`: a reward function (`reward.functions = ["streamrl.rollout.envs.reasoning_gym:score"]`).
- `ReasoningGymEnv` (`env.name = "reasoning_gym"`): the same score as an environment, with
  `attempts > 1` turning a wrong answer into feedback and another try (the last try's score counts).

Scoring regenerates the entry from `rg_task` (the generators are deterministic) rather than
reading metadata back from the row: metadata through JSON loses tuples, and the ARC tasks' scorers
then score their own reference answer 0.05. Needs the `reasoning-gym` package.
"""

from __future__ import annotations

import functools
import json
import os

DEFAULT_SIZE = 1000


def _rg():
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"reasoning_gym data needs the reasoning-gym package ({e}): pip install reasoning-gym") from e
    return reasoning_gym


def parse_spec(spec: str) -> tuple[str, int, int]:
    """`reasoning_gym:NAME[:SIZE[:SEED]]` -> (name, size, seed)."""
    prefix, _, rest = spec.partition(":")
    parts = rest.split(":")
    if prefix != "reasoning_gym" or not parts[0] or len(parts) > 3:
        raise ValueError(f"data.path = {spec}: write reasoning_gym:NAME[:SIZE[:SEED]], e.g. reasoning_gym:syllogism")
    try:
        size = int(parts[1]) if len(parts) > 1 else DEFAULT_SIZE
        seed = int(parts[2]) if len(parts) > 2 else 0
    except ValueError:
        raise ValueError(f"data.path = {spec}: SIZE and SEED are whole numbers") from None
    return parts[0], size, seed


def rows(spec: str) -> list[dict]:
    """The rows of the task `spec` names (see the module docstring)."""
    name, size, seed = parse_spec(spec)
    rg = _rg()
    if name not in rg.factory.DATASETS:
        import difflib

        tasks = sorted(rg.factory.DATASETS)
        close = difflib.get_close_matches(name, tasks, n=3)
        hint = f"did you mean {' or '.join(close)}?" if close else f"its {len(tasks)} tasks: {', '.join(tasks)}"
        raise ValueError(f"data.path = {spec}: reasoning-gym has no task {name!r}; {hint}")
    system = rg.utils.SYSTEM_PROMPTS["default"]
    out = []
    for index, entry in enumerate(_dataset(name, size, seed)):
        out.append(
            {
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}],
                "prompt": entry["question"],
                "answer": "" if entry["answer"] is None else str(entry["answer"]),
                "rg_task": [name, size, seed, index],
            }
        )
    return out


@functools.lru_cache(maxsize=64)
def _dataset(name: str, size: int, seed: int):
    return _rg().create_dataset(name, size=size, seed=seed)


def score_one(completion: str, task: list) -> float:
    """The task's score of the answer inside the completion's last `<answer>` tags (0.0 without them)."""
    name, size, seed, index = task
    dataset = _dataset(name, int(size), int(seed))
    return float(dataset.score_answer(_rg().utils.extract_answer(completion), dataset[int(index)]))


def score(prompts, completions, completion_ids, rg_task, **_) -> list[float]:
    """Reward function over a batch (the dataset's columns arrive as keyword lists)."""
    return [score_one(c, task) for c, task in zip(completions, rg_task, strict=True)]


score.warm_up = _rg  # the reward worker imports reasoning-gym when it starts (seconds), not in a call's deadline
# no trial call in preflight (rewards/trial.py): the library's own scoring, whose worker would import the library
# for it (8 s for reasoning-gym, 40 s for verifiers on a loaded 2-core machine) and find nothing the rows check misses
score.streamrl_trial = False


class ReasoningGymEnv:
    def __init__(self, attempts: int = 1, feedback: str = "That is not correct. Try again."):
        if attempts < 1:
            raise ValueError(f"reasoning_gym env: attempts = {attempts}; give at least 1")
        self.attempts, self.feedback = attempts, feedback
        self.task: list = []

    def reset(self, row: dict) -> None:
        if not isinstance(row.get("rg_task"), list) or len(row["rg_task"]) != 4:
            raise ValueError("row has no rg_task [NAME, SIZE, SEED, INDEX]: make the rows with reasoning_gym.rows()")
        self.task = row["rg_task"]
        return None  # the row's own prompt

    def step(self, completion: str) -> tuple[str | None, float, bool]:
        self.attempts -= 1
        value = score_one(completion, self.task)
        if value >= 1.0 or self.attempts == 0:
            return None, value, True
        return self.feedback, 0.0, False


def write_rows(name: str, size: int, seed: int, out: str | os.PathLike) -> int:
    """The task's rows as a jsonl prompt file at `out`; returns how many."""
    written = rows(f"reasoning_gym:{name}:{size}:{seed}")
    with open(out, "w") as f:
        for row in written:
            f.write(json.dumps(row) + "\n")
    return len(written)
