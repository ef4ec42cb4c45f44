"""The learner's side of evaluations during training: which versions, posting them, collecting what the nodes
hand in, and reporting it. It scores nothing: rewards are computed on the nodes (rollout/evaluation.py).

Versions: 0 before training (eval.before_training), every `eval.every`-th, and the last (engine/config/eval.due).
A version's job is posted before its weights are published, so a node finds it the moment the version goes live
(`before_publish`); `collect` reports every job whose chunks are all in, at each step; `finish` waits for the
last ones after the last step and reports what is still missing as incomplete, with its coverage. Reported:
`eval/<source>/...` metrics (with the version and the step that made it) in the record of the step that
collected them, so through the run's sinks (metrics.jsonl, TensorBoard, W&B, Prometheus) and with metrics.jsonl
still one record a step; one log line; `RUN/eval/<source>/v<N>.jsonl`.

A sample at any version but its job's is refused here too (counted in `eval/<source>/wrong_version` and left out;
the node refuses them first): every sample written is of the version it reports.
"""

from __future__ import annotations

import logging
import pathlib
import time

from streamrl.engine.config import Config
from streamrl.engine.config.eval import due
from streamrl.engine.ledger.eval_jobs import EvalJobs
from streamrl.learner.evaluation.report import Evaluation, Sample, line

log = logging.getLogger("streamrl.learner.eval")

POLL_S = 0.2


class Evaluations:
    """Posts, collects and reports a run's evaluations (module doc)."""

    def __init__(self, cfg: Config, jobs: EvalJobs, run_dir: pathlib.Path, last_version: int):
        self.cfg, self.jobs, self.run_dir = cfg, jobs, pathlib.Path(run_dir)
        self.last_version = last_version
        self.posted: set[int] = set()
        self.reported: list[Evaluation] = []

    def before_publish(self, version: int, step: int, last: bool = False) -> None:
        """Post the evaluation of `version` (made by `step`) if it is due; before its weights go out."""
        if version in self.posted or not (due(self.cfg.eval, version, self.last_version) or last):
            return
        if not self.cfg.eval.enabled:
            return
        self.jobs.post(version, step)
        self.posted.add(version)
        log.info("evaluation of version %d posted (step %d)", version, step)

    def collect(self) -> dict[str, float]:
        """Report every posted job whose chunks are all in; their metrics, for the step's record."""
        metrics: dict[str, float] = {}
        for version in sorted(self.posted & self.jobs.open_versions()):
            if self.jobs.finished(version):
                metrics.update(self._report(version))
        return metrics

    def finish(self, timeout_s: float) -> dict[str, float]:
        """After the last step: wait up to `timeout_s` for the open jobs, then report the rest incomplete."""
        metrics, deadline = self.collect(), time.monotonic() + timeout_s
        while self.posted & self.jobs.open_versions() and time.monotonic() < deadline:
            time.sleep(POLL_S)
            metrics.update(self.collect())
        for version in sorted(self.posted & self.jobs.open_versions()):
            log.warning("evaluation of version %d did not complete within %g s", version, timeout_s)
            metrics.update(self._report(version))
        return metrics

    def figures(self, last: bool) -> dict[str, float]:
        """What a step's record carries: the evaluations done since the last step; at the last step, every
        open one, waited for up to `weights.timeout_s` (a node's swap deadline: the longest a node may hold)."""
        return self.finish(self.cfg.weights.timeout_s) if last else self.collect()

    def _report(self, version: int) -> dict[str, float]:
        progress = self.jobs.progress(version)
        samples: dict[str, list[Sample]] = {s.name: [] for s in self.cfg.eval.sources}
        wrong: dict[str, int] = dict.fromkeys(samples, 0)
        for result in self.jobs.results(version):
            for s in result.samples:
                if s.versions not in ([version], []):
                    wrong[result.chunk.source] += 1
                    continue
                samples[result.chunk.source].append(Sample.of(s, version, result.node))
        evaluations, metrics = [], {}
        for name, found in samples.items():
            asked = progress.asked.get(name, 0)
            ev = Evaluation(source=name, version=version, n=self.cfg.eval.n, asked=asked,
                            threshold=self.cfg.eval.pass_threshold, samples=found)  # fmt: skip
            ev.write_samples(self.run_dir)
            metrics.update(ev.metrics())
            metrics.update(
                {f"eval/{name}/wrong_version": float(wrong[name]), f"eval/{name}/step": float(progress.step)}
            )
            log.info("%s", line(ev))
            evaluations.append(ev)
        complete = all(e.summary()["complete"] for e in evaluations) and not any(wrong.values())
        done = {e.source: int(e.summary()["prompts_done"]) for e in evaluations}
        self.jobs.close(version, "complete" if complete else "incomplete", done)
        self.reported += evaluations
        return metrics


def start(cfg: Config, orchestrator, version: int, first_step: int) -> Evaluations:
    """Rank 0's evaluations of the run, over the orchestrator's ledger; a fresh run's version 0 posted now,
    before any node generates (a resumed run's versions from its first step on)."""
    jobs = EvalJobs(orchestrator.ledger.client, cfg.run.name)
    evaluations = Evaluations(cfg, jobs, cfg.run.path, last_version=cfg.run.steps)
    if first_step == 1:
        evaluations.before_publish(version, 0)
    return evaluations
