"""A node's share of evaluations: chunks of held-out prompts generated at exactly the version being evaluated.

The learner posts an evaluation of version v before v goes live (engine/ledger/eval_jobs.py). A node live at
v lays the job out if no node did, then takes chunks one at a time, generates each prompt's `eval.n` samples
with the evaluation's sampling (engine/config/eval.sampling), scores them with the evaluation's rewards and
hands them in, while its training groups go on beside them. With an [env], a prompt's samples are episodes of
the run's environment, rewarded by it (rollout/evaluation_episodes.py).

How the version is kept exact: the engine's swap to the next version waits on `before_swap` (after the new
weights are staged, before the old ones are replaced), which finishes the evaluation of the live version:
this node's chunks and, while chunks of it are held by other nodes, the wait for their results or their
leases to expire (then this node takes them over). From then on no evaluation request starts at that version
on this node. Every sample carries the versions its tokens were generated at; one at another version is a
defect, refused here and again by the learner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from streamrl.engine.config import Config
from streamrl.engine.config.eval import reward_config, sampling, source_data
from streamrl.engine.ledger.eval_jobs import EvalChunk, EvalChunkResult, EvalJobs, EvalSampleRecord
from streamrl.rollout.evaluation_episodes import episode_runner, run_episodes
from streamrl.rollout.evaluation_prompts import eval_prompts
from streamrl.rollout.sources import Prompt, prompt_text

log = logging.getLogger("streamrl.rollout.eval")

POLL_S = 0.2  # how often a node looks for an evaluation of its live version, and for chunks held elsewhere


class VersionMismatchError(RuntimeError):
    """An evaluation sample generated at a version other than its job's: a defect, never handed in."""


class EvalWorker:
    """Serves the evaluations of whatever version the node's engine has live (module doc)."""

    def __init__(self, cfg: Config, node_id: str, engine, tokenizer, jobs: EvalJobs, lease_s: float):
        from streamrl.rewards import build_scorer

        self.cfg, self.node_id, self.engine, self.tokenizer, self.jobs = cfg, node_id, engine, tokenizer, jobs
        self.lease_s = lease_s
        self.sampling = sampling(cfg.eval, cfg.rollout)
        self.prompts: dict[str, list[Prompt]] = {s.name: eval_prompts(s, cfg, tokenizer) for s in cfg.eval.sources}
        self.runner = None  # with [env]: the evaluation's episodes, rewarded by the environment (no scorer)
        self.scorers = {}
        if cfg.env.name:
            self.runner = episode_runner(cfg, engine, tokenizer)
        else:
            rewards = reward_config(cfg.eval, cfg.reward)
            self.scorers = {s.name: build_scorer(rewards, source_data(s, cfg.data).answer_column)
                            for s in cfg.eval.sources}  # fmt: skip
        self._serving: dict[int, asyncio.Task] = {}
        self._closed = -1  # the version whose evaluation this node finished before swapping away from it
        self.chunks_done = 0

    async def watch(self, stopping: asyncio.Event) -> None:
        """Until `stopping`: serve the evaluation of the live version as soon as it is posted."""
        while not stopping.is_set():
            version = self.engine.policy_version
            try:
                if version != self._closed and version in await asyncio.to_thread(self.jobs.open_versions):
                    await self._serve(version)
            except Exception:  # noqa: BLE001 - the evaluation is the learner's to call incomplete; training goes on
                log.exception("node %s: evaluation of version %d failed here", self.node_id, version)
            try:
                await asyncio.wait_for(stopping.wait(), POLL_S)
            except TimeoutError:
                pass

    async def before_swap(self) -> None:
        """The engine's hook between staging the next version and swapping it in (module doc)."""
        version = self.engine.policy_version
        try:
            if version in await asyncio.to_thread(self.jobs.open_versions):
                await self._serve(version)
        except Exception:  # noqa: BLE001 - a failed evaluation never holds the weights back
            log.exception("node %s: evaluation of version %d failed before the swap", self.node_id, version)
        finally:
            self._closed = version

    def _serve(self, version: int) -> asyncio.Future:
        """The one task that serves `version`'s evaluation on this node (the watcher and the hook share it)."""
        task = self._serving.get(version)
        if task is None or task.done():
            task = self._serving[version] = asyncio.ensure_future(self._serve_version(version))
        return asyncio.shield(task)

    async def _serve_version(self, version: int) -> None:
        counts = {name: len(prompts) for name, prompts in self.prompts.items()}
        await asyncio.to_thread(self.jobs.lay_out, version, counts)
        while self.engine.policy_version == version and self._closed != version:
            chunk = await asyncio.to_thread(self.jobs.claim, version, self.node_id, self.lease_s)
            if chunk is not None:
                await self._chunk(chunk)
                continue
            if await asyncio.to_thread(self.jobs.finished, version):
                return
            # chunks held by other nodes: wait for their results, or take them over once their lease ends
            await asyncio.to_thread(self.jobs.requeue_lost, version)
            await asyncio.sleep(POLL_S)

    async def _chunk(self, chunk: EvalChunk) -> None:
        prompts = self.prompts[chunk.source][chunk.start : chunk.stop]
        source = next(x for x in self.cfg.eval.sources if x.name == chunk.source)
        started = time.monotonic()
        data = source_data(source, self.cfg.data)
        if self.runner is not None:
            samples = await run_episodes(self.runner, self.tokenizer, prompts, data, self.cfg.eval.n)
        else:
            samples = await generate_and_score(self.engine, self.tokenizer, self.scorers[chunk.source], prompts,
                                               data, self.sampling)  # fmt: skip
        wrong = [x.versions for x in samples if x.versions not in ([chunk.version], [])]  # []: no token made
        if wrong:
            raise VersionMismatchError(f"chunk {chunk.id} of version {chunk.version} generated at {wrong[0]}")
        await asyncio.to_thread(self.jobs.submit, EvalChunkResult(chunk=chunk, node=self.node_id, samples=samples))
        self.chunks_done += 1
        log.debug("node %s: eval chunk %s at v%d in %.2f s", self.node_id, chunk.id, chunk.version,
                  time.monotonic() - started)  # fmt: skip

    def close(self) -> None:
        for scorer in self.scorers.values():
            scorer.close()
        if self.runner is not None:
            self.runner.close()


async def generate_and_score(
    engine, tokenizer, scorer, prompts: list[Prompt], data, sampling
) -> list[EvalSampleRecord]:
    """Each prompt's `sampling.group_size` samples, generated together with `sampling`, decoded and scored in one
    reward call (the node's chunks and `streamrl eval` alike); `data`: the source's columns."""
    n, limit = sampling.group_size, sampling.max_tokens
    groups = await asyncio.gather(*(engine.generate(p.prompt_ids, n, limit, sampling=sampling) for p in prompts))
    flat = [(p, c) for p, group in zip(prompts, groups, strict=True) for c in group]
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for _, c in flat]
    asked = [prompt_text(p, data) for p, _ in flat]
    ids, rows = [c.token_ids for _, c in flat], [p.row for p, _ in flat]
    rewards = await asyncio.to_thread(scorer.score, asked, texts, ids, rows)
    return [_record(p, c, a, t, r) for (p, c), a, t, r in zip(flat, asked, texts, rewards, strict=True)]


def _record(prompt: Prompt, c, asked: str, text: str, reward: float | None) -> EvalSampleRecord:
    versions = sorted(set(c.token_versions))
    return EvalSampleRecord(row=prompt.row_number, prompt=asked, completion=text, reward=reward,
                            tokens=len(c.token_ids), finish_reason=c.finish_reason, versions=versions)  # fmt: skip


@contextlib.asynccontextmanager
async def evaluating(cfg: Config, node_id: str, engine, tokenizer, ledger):
    """A node's evaluation worker while it serves a learner (`ledger`: that learner's): watching for
    evaluations of the live version and hooked before each swap. Nothing without [eval] or with simulated
    generation. A chunk's lease is `ledger.heartbeat_ttl_s`: a dead node's chunk is taken over that late."""
    if not cfg.eval.enabled or cfg.simulate.gen_s > 0:
        yield None
        return
    jobs = EvalJobs(ledger.client, ledger.run)
    worker = await asyncio.to_thread(EvalWorker, cfg, node_id, engine, tokenizer, jobs, cfg.ledger.heartbeat_ttl_s)
    engine.before_swap = worker.before_swap
    stopping = asyncio.Event()
    watcher = asyncio.create_task(worker.watch(stopping), name="eval-watch")
    try:
        yield worker
    finally:
        stopping.set()
        engine.before_swap = None
        await watcher
        worker.close()
