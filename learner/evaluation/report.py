"""What an evaluation leaves behind: `eval/<source>/<metric>` metrics, the samples a person reads, one line each.

Samples go to `OUT/eval/<source>/v<version>.jsonl`, one JSON object a sample: the prompt's row number and
text, the completion's text, its reward, the policy version that generated it, its tokens and finish reason,
and the node that generated it (`"local"` for `streamrl eval`), sorted by row so two versions' files line up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from streamrl.engine.ledger.eval_jobs import EvalSampleRecord
from streamrl.learner.evaluation.metrics import Scored, summarize

PREFIX = "eval"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One evaluation sample as it is written for a person to read."""

    row: int  # the prompt's row number in its source
    prompt: str
    completion: str
    reward: float | None
    version: int  # the policy version that generated every token of it
    tokens: int
    finish_reason: str
    node: str = "local"

    @classmethod
    def of(cls, record: EvalSampleRecord, version: int, node: str) -> Sample:
        """A sample as a node (or `streamrl eval`) handed it in, generated at `version`."""
        return cls(row=record.row, prompt=record.prompt, completion=record.completion, reward=record.reward,
                   version=version, tokens=record.tokens, finish_reason=record.finish_reason, node=node)  # fmt: skip

    def scored(self) -> Scored:
        return Scored(prompt=self.row, reward=self.reward, tokens=self.tokens, truncated=self.finish_reason == "length")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Evaluation:
    """The samples of one source at one version, with what was asked of it."""

    source: str
    version: int
    n: int  # samples per prompt
    asked: int  # prompts asked for
    threshold: float  # eval.pass_threshold
    samples: list[Sample]

    def summary(self) -> dict[str, float]:
        """`metrics.summarize` of its samples (coverage always; means only when complete)."""
        return summarize([s.scored() for s in self.samples], self.n, self.asked, self.threshold)

    def metrics(self) -> dict[str, float]:
        """`eval/<source>/<name>` of every figure, and the version it is of."""
        figures = {f"{PREFIX}/{self.source}/{k}": v for k, v in self.summary().items()}
        return {**figures, f"{PREFIX}/{self.source}/version": float(self.version)}

    def write_samples(self, out: pathlib.Path) -> pathlib.Path:
        """`out/eval/<source>/v<version>.jsonl` (replaced whole: a file is one evaluation)."""
        path = samples_path(out, self.source, self.version)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = sorted(self.samples, key=lambda s: s.row)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in rows))
        tmp.replace(path)
        return path


def samples_path(out: pathlib.Path, source: str, version: int) -> pathlib.Path:
    return pathlib.Path(out) / PREFIX / source / f"v{version}.jsonl"


def read_samples(path: pathlib.Path) -> list[Sample]:
    return [Sample(**json.loads(line)) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def line(ev: Evaluation) -> str:
    """One line a person reads: `eval held (v3): pass@1 0.250, mean@4 0.410, ... 32/32 prompts`."""
    s = ev.summary()
    covered = f"{s['prompts_done']:.0f}/{s['prompts_asked']:.0f} prompts"
    if not s["complete"]:
        return f"eval {ev.source} (v{ev.version}): INCOMPLETE, {covered} covered; no mean reported"
    names = [f"pass@{k}" for k in sorted({1, ev.n})] + [f"mean@{ev.n}", f"best@{ev.n}"] * (ev.n > 1)
    figures = ", ".join(f"{name} {s[name]:.3f}" for name in names)
    return (
        f"eval {ev.source} (v{ev.version}): {figures}, reward {s['reward_mean']:.3f}, "
        f"{s['completion_tokens']:.1f} tokens, {s['truncated_share']:.0%} truncated, {covered}"
    )


def first_to_last(records: list[dict]) -> list[str]:
    """`eval <source>: pass@1 0.06 → 0.97 (v0 → v20)` per source, from metrics.jsonl records; an evaluation
    that did not complete is named as such instead of a figure."""
    by_source: dict[str, list[dict]] = {}
    for record in records:
        for key in record:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == PREFIX and parts[2] == "complete":
                by_source.setdefault(parts[1], []).append(record)
    out = []
    for source, found in by_source.items():
        first, last = found[0], found[-1]
        out.append(f"eval {source}: pass@1 {_figure(first, source)} → {_figure(last, source)} "
                   f"(v{_version(first, source)} → v{_version(last, source)})")  # fmt: skip
    return out


def _figure(record: dict, source: str) -> str:
    value = record.get(f"{PREFIX}/{source}/pass@1")
    if not record.get(f"{PREFIX}/{source}/complete") or not isinstance(value, float) or math.isnan(value):
        done, asked = record.get(f"{PREFIX}/{source}/prompts_done", 0), record.get(f"{PREFIX}/{source}/prompts_asked")
        return f"incomplete ({done:.0f}/{asked:.0f})"
    return f"{value:.2f}"


def _version(record: dict, source: str) -> str:
    return f"{record.get(f'{PREFIX}/{source}/version', -1):.0f}"
