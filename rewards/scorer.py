"""`Scorer`: the one object a rollout node calls to reward a batch of completions.

Each configured reward runs in one of three places: the worker pool (with a deadline per call;
the default), inline in the caller (reward.workers = 0: no deadline can be enforced), or, for
`reward_model`, a model on the caller's device. The combined reward is the weighted sum; a
sample with any component None gets None, which the ledger records as a `reward_error` drop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import traceback
from typing import Any

from streamrl.engine.config import RewardConfig

from .call import Batch, CallOutcome, rows_to_columns, safe_call
from .registry import REWARD_MODEL, resolve

log = logging.getLogger("streamrl.rewards")


@dataclasses.dataclass
class ScorerStats:
    """Running counts since the scorer was built; `errors` and `timeouts` count samples."""

    calls: int = 0  # score() calls
    samples: int = 0
    errors: int = 0  # samples a reward raised on (or returned a non-finite value for)
    timeouts: int = 0  # samples whose reward call passed its deadline
    none: int = 0  # samples whose combined reward is None
    restarts: int = 0  # pool workers replaced after a hang or a crash
    by_function: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        metrics = {
            f"reward/{k}": float(getattr(self, k))
            for k in ("calls", "samples", "errors", "timeouts", "none", "restarts")
        }
        for spec, counts in self.by_function.items():
            metrics.update({f"reward/{k}/{spec}": float(v) for k, v in counts.items()})
        return metrics


def combine(components: list[list[float | None]], weights: list[float]) -> list[float | None]:
    """Weighted sum per sample across reward components; None when any component is None."""
    out: list[float | None] = []
    for values in zip(*components, strict=True):
        if any(v is None for v in values):
            out.append(None)
        else:
            out.append(sum(w * v for w, v in zip(weights, values, strict=True)))
    return out


class Scorer:
    """Scores batches with the configured rewards; see the module docstring for where each runs."""

    def __init__(self, cfg: RewardConfig, pool=None, model=None, answer_column: str = "answer"):
        self.cfg = cfg
        self.answer_column = answer_column
        self.specs = list(cfg.functions)
        self.weights = list(cfg.weights) or [1.0] * len(self.specs)
        # resolved here even when the pool runs them: a bad spec fails now, in the caller, named
        self.functions = {i: resolve(s, cfg) for i, s in enumerate(self.specs) if s != REWARD_MODEL}
        self.pool = pool
        self.model = model
        self.stats = ScorerStats(by_function={s: {"errors": 0, "timeouts": 0} for s in self.specs})
        self._logged: set[str] = set()
        self.first_error = ""  # "SPEC: the exception's last line", of the first reward that failed
        self._lock = threading.Lock()  # one batch at a time: the pool's workers are shared state
        self.closed = False

    def score(
        self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], columns: list[dict]
    ) -> list[float | None]:
        """One combined reward per sample (None where a component failed); columns[i] is sample i's row."""
        if self.closed:
            raise RuntimeError("score() on a closed Scorer; build a new one with build_scorer(cfg)")
        n = len(completions)
        if len(prompts) != n or len(completion_ids) != n:
            raise ValueError(
                f"score(): {len(prompts)} prompts, {n} completions, {len(completion_ids)} "
                "completion_ids; give one of each per sample"
            )
        batch = Batch(
            prompts=list(prompts),
            completions=list(completions),
            completion_ids=[list(ids) for ids in completion_ids],
            columns=rows_to_columns(columns, n, self.answer_column),
        )
        with self._lock:
            components = self._components(batch) if n else [[] for _ in self.specs]
            rewards = combine(components, self.weights)
            self.stats.calls += 1
            self.stats.samples += n
            self.stats.none += sum(r is None for r in rewards)
        return rewards

    async def score_async(
        self, prompts: list[str], completions: list[str], completion_ids: list[list[int]], columns: list[dict]
    ) -> list[float | None]:
        """`score` on a thread, for callers on an event loop (the rollout's AsyncLLM loop)."""
        return await asyncio.to_thread(self.score, prompts, completions, completion_ids, columns)

    def _components(self, batch: Batch) -> list[list[float | None]]:
        outcomes: dict[int, CallOutcome] = {}
        if self.pool is not None:
            pooled = list(self.functions)
            outcomes.update(zip(pooled, self.pool.run(pooled, batch)))
        else:
            outcomes.update({i: safe_call(fn, batch) for i, fn in self.functions.items()})
        for i, spec in enumerate(self.specs):
            if spec == REWARD_MODEL:
                outcomes[i] = self._model_outcome(batch)
        for i, outcome in outcomes.items():
            self._account(self.specs[i], outcome)
        return [outcomes[i].values for i in range(len(self.specs))]

    def _model_outcome(self, batch: Batch) -> CallOutcome:
        if self.model is None:
            raise RuntimeError(
                "reward_model is in reward.functions but no reward model was built; "
                "use build_scorer(cfg), which loads reward.model.path"
            )
        try:
            return CallOutcome(values=self.model.score(batch.prompts, batch.completions))
        except Exception:
            return CallOutcome(values=[None] * len(batch), errors=len(batch), traceback=traceback.format_exc())

    def _account(self, spec: str, outcome: CallOutcome) -> None:
        self.stats.errors += outcome.errors
        self.stats.timeouts += outcome.timeouts
        self.stats.by_function[spec]["errors"] += outcome.errors
        self.stats.by_function[spec]["timeouts"] += outcome.timeouts
        if outcome.traceback and spec not in self._logged:
            self._logged.add(spec)
            if outcome.errors and not self.first_error:
                self.first_error = f"{spec}: {outcome.traceback.strip().splitlines()[-1]}"
            self._say_once(spec, outcome)
        if self.pool is not None:
            self.stats.restarts = self.pool.restarts

    def _say_once(self, spec: str, outcome: CallOutcome) -> None:
        """The first failure of `spec`, with its traceback; later ones are only counted. A batch that fell back is
        a WARNING whose first line says what happened: that line is what the live view of `streamrl run` shows
        (ops/phases.py reads the node's console), the node's log has the rest."""
        later = "later failures are only counted, in reward/errors and reward/timeouts"
        if outcome.fell_back:
            n, last = len(outcome.values), outcome.traceback.strip().splitlines()[-1]
            log.warning(
                "reward %r raised on a batch of %d samples (%s); each sample was scored alone, %d failed (dropped "
                "as reward_error); %s\n%s",
                spec, n, last, outcome.errors, later, outcome.traceback,
            )  # fmt: skip
            return
        log.error("reward %r failed (first failure shown once; %s):\n%s", spec, later, outcome.traceback)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self.pool is not None:
                self.pool.close()
                self.pool = None

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_scorer(cfg: RewardConfig, answer_column: str = "answer") -> Scorer:
    """The scorer for `cfg`: resolves every reward now (a bad spec fails here, named), starts the pool.

    `answer_column` (data.answer_column) is also passed to rewards as `answer`, which built-ins read.
    """
    model = None
    if REWARD_MODEL in cfg.functions:
        from .model import RewardModel

        model = RewardModel(cfg.model)
    scorer = Scorer(cfg, pool=None, model=model, answer_column=answer_column)
    if cfg.workers > 0 and scorer.functions:
        from .pool import RewardPool

        scorer.pool = RewardPool(scorer.specs, cfg)
    return scorer
