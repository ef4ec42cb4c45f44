"""The rollout node loop: prompt -> credit -> generate a group -> score -> send each trajectory.

Up to `rollout.max_concurrent_groups` groups (engine.config.rules.node_groups) are in flight at once
(asyncio tasks); the engine batches them. Seams the end-to-end wiring fills (rollout/seams.py): `credits`
(admission; unlimited by default), the sink and the scorer; and `apply_weights` (a new policy between or
during generation), and `stop` (finish in-flight groups within a grace period, abandon the rest and
report them). What a group is (generated, scored, made into trajectories) is rollout/groups.py's;
completions are decoded only for the rewards; trajectories carry token ids. A slot is given to work in
one place (`_start_next`): other kinds of work than training groups would be served there.

With `env.name` set, a group is `rollout.group_size` multi-turn episodes of the row instead
(rollout/envs): the environment's rewards replace reward.functions. An episode that fails
(env_error, env_timeout, env_malformed, episode_timeout, overlong) is dropped in the ledger with
that reason; the group's other episodes are sent as a smaller group (`group_size` = the survivors),
so their advantages are taken over the survivors. Dropping the whole group instead would throw
away good episodes without telling the learner anything more: a failed episode has no reward to
compare against, and an environment's bug is not the model's fault to penalise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import uuid
from collections.abc import Iterable, Iterator

from streamrl.engine.config import Config
from streamrl.engine.ledger import sample_ids as ledger_sample_ids
from streamrl.engine.messages import Trajectory, WeightsReady
from streamrl.engine.placement import node_groups
from streamrl.engine.telemetry import EventLog
from streamrl.engine.weights.paths import SHARED
from streamrl.rollout.backends.protocol import GenerationBackend
from streamrl.rollout.envs.episode import build_runner
from streamrl.rollout.groups import GroupMaker
from streamrl.rollout.seams import Credits, NodeStats, Scorer, TrajectorySink, UnlimitedCredits
from streamrl.rollout.sources import Prompt

log = logging.getLogger(__name__)

CREDIT_RETRY_S = 0.01  # a refused credit is asked again this soon (sync mode: right after new weights)
MAX_FAILURES_IN_A_ROW = 5


def sleeps_on(cfg: Config, weights_path: str, engine: GenerationBackend) -> bool:
    """Sync mode on the learner's device (weights by shared memory or CUDA IPC) with an engine that can
    sleep: the node sleeps while the learner trains (`RolloutNode.sleeps`)."""
    if cfg.run.mode == "sync" and weights_path in SHARED and getattr(engine, "can_sleep", False):
        log.info("sync mode on the learner's device: the engine sleeps while the learner trains")
        return True
    return False


class RolloutNode:
    def __init__(
        self,
        cfg: Config,
        node_id: str,
        engine: GenerationBackend,
        source: Iterable[Prompt],
        scorer: Scorer,
        sink: TrajectorySink,
        tokenizer,
        credits: Credits | None = None,
        events: EventLog | None = None,
        device: str = "cpu",
    ):
        """events: where the live view learns of each version going live (`RUN/events.jsonl`); device: the
        engine's, which sets how many groups run at once when the config leaves it to the engine."""
        self.cfg, self.node_id, self.engine, self.events = cfg, node_id, engine, events
        self.concurrency = node_groups(cfg, device)
        self.source, self.scorer, self.sink, self.tokenizer = source, scorer, sink, tokenizer
        self.credits = credits or UnlimitedCredits()
        self.stats = NodeStats()
        self._failures_in_a_row = 0
        self.in_flight: dict[str, asyncio.Task] = {}
        self._stopping: asyncio.Event | None = None
        self._fatal: BaseException | None = None
        self._groups = itertools.count()
        self._incarnation = uuid.uuid4().hex[:6]  # a restarted node with the same id never reuses a group id
        self._weights_lock = asyncio.Lock()
        # sync mode on the learner's device (set from the Welcome, rollout/service.py): the engine sleeps before
        # the node sends the last group it was generating, so the learner trains in the room it frees (`_sleep`)
        self.sleeps = False
        self._refused_at = -1  # the version a refused credit was asked at (no group left for it); -1: granted
        self._generating = 0  # groups started and not yet generated and scored
        self._send_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trajectory-send")
        self.episodes = build_runner(cfg, engine, tokenizer) if cfg.env.name else None
        if self.episodes is not None:  # the runner's live counters
            self.stats.episodes_dropped, self.stats.episode_limits = self.episodes.failures, self.episodes.limits
        self.groups = GroupMaker(cfg, node_id, engine, scorer, tokenizer, self.credits, self.stats, self.episodes)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def run(self, max_groups: int | None = None, grace_s: float = 30.0) -> NodeStats:
        """Generate until the source ends, `max_groups` groups started, `stop()` or a fatal send error."""
        self._stopping = asyncio.Event()
        limit = asyncio.Semaphore(self.concurrency)
        prompts = iter(self.source)
        try:
            while max_groups is None or self.stats.groups_started < max_groups:
                if not await self._slot(limit):
                    break
                if not await self._start_next(prompts, limit):
                    limit.release()
                    break
        finally:
            await self._drain(grace_s)
            self._send_thread.shutdown(wait=True)
            if self.episodes is not None:
                self.episodes.close()
                log.info(
                    "node %s episodes: dropped %s, cut by limits %s",
                    self.node_id,
                    dict(self.episodes.failures),
                    dict(self.episodes.limits),
                )
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    async def _slot(self, limit: asyncio.Semaphore) -> bool:
        """Wait for room for one more group; False (holding nothing) once stopping. With room free it is taken
        without a turn of the event loop: the node fills its slots at once, as a client submitting every request
        together does (a turn per group let vLLM's output handler run a chunk between two admissions)."""
        if not limit.locked() and not self._stopping.is_set():
            return await limit.acquire()  # returns at once: nothing to wait for
        acquire = asyncio.ensure_future(limit.acquire())
        stopping = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait([acquire, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not self._stopping.is_set():
            return True
        if acquire.done() and not acquire.cancelled():
            limit.release()
        acquire.cancel()
        return False

    async def _start_next(self, prompts: Iterator[Prompt], limit: asyncio.Semaphore) -> bool:
        """Give the slot just taken to the next piece of work: a training group of the next prompt. The one
        place a slot is handed out, between groups: another kind of work (evaluation prompts, say) would be
        served here, in a slot of its own. False (the slot unused) when the source ended or the node stops."""
        prompt = next(prompts, None)
        return prompt is not None and await self._admit(prompt, limit)

    async def _admit(self, prompt: Prompt, limit: asyncio.Semaphore) -> bool:
        """Take a credit for a new group (retrying while none is free) and start it; False when stopping."""
        group_id = f"{self.node_id}-{self._incarnation}-g{next(self._groups)}"
        sample_ids = ledger_sample_ids(group_id, self.cfg.rollout.group_size)  # the ids the ledger admits
        while True:
            asked = self.engine.policy_version
            if await self.credits.acquire(group_id, sample_ids):
                break
            self._refused_at = asked
            if self._stopping.is_set():
                return False
            if not self.in_flight:
                await self._sleep()
            await asyncio.sleep(CREDIT_RETRY_S)
        self._refused_at = -1
        self.stats.groups_started += 1
        task = asyncio.create_task(self._group(group_id, sample_ids, prompt), name=group_id)
        self.in_flight[group_id] = task
        task.add_done_callback(lambda t: self._group_done(t, limit))
        return True

    def _group_done(self, task: asyncio.Task, limit: asyncio.Semaphore) -> None:
        self.in_flight.pop(task.get_name(), None)
        limit.release()
        if not task.cancelled() and task.exception() is not None and self._fatal is None:
            self._fatal = task.exception()

    async def _group(self, group_id: str, sample_ids: list[str], prompt: Prompt) -> None:
        self._generating += 1
        try:
            try:
                trajectories = await self.groups.make(group_id, sample_ids, prompt)
            finally:
                self._generating -= 1
        except asyncio.CancelledError:
            self.stats.abandoned.append(group_id)
            await self.credits.release(group_id, sample_ids, "abandoned")
            raise
        except Exception as e:
            log.exception("group %s failed before sending; its credit is released", group_id)
            self.stats.groups_failed += 1
            self._failures_in_a_row += 1
            await self.credits.release(group_id, sample_ids, f"error: {type(e).__name__}")
            if self._failures_in_a_row >= MAX_FAILURES_IN_A_ROW and self._fatal is None:
                # A broken engine fails every group: stop loudly instead of spinning on credits.
                self._fatal = RuntimeError(
                    f"{self._failures_in_a_row} groups in a row failed; the last: {type(e).__name__}: {e}"
                )
                self.stop("every group fails")
            return
        self._failures_in_a_row = 0
        if not self._generating:  # its last group of the version: room before the learner trains on them
            await self._sleep(last_group=True)
        if trajectories:
            await self._send(trajectories)
            self.stats.groups_sent += 1

    async def _send(self, trajectories: list[Trajectory]) -> None:
        """Send a group in the one sender thread (ZMQ sockets are not thread-safe), in one hop to it: a hop a
        sample waited for the GIL vLLM's front end holds each time. A blocked send is backpressure."""

        def send_all() -> None:
            for traj in trajectories:
                self.sink.send(traj)
                self.stats.samples_sent += 1  # only this thread counts them
                self.stats.tokens_sent += traj.model_tokens

        try:
            await asyncio.get_running_loop().run_in_executor(self._send_thread, send_all)
        except Exception as e:  # the learner is gone: nothing further can be delivered
            self._fatal = self._fatal or e
            self.stop(f"send failed: {e}")
            raise

    async def _sleep(self, last_group: bool = False) -> None:
        """Put the engine to sleep (`sleeps`): before sending the last group it was generating (`last_group`: in
        sync mode the step's groups were admitted long before they finish, and a node holding as many as its
        slots never gets to ask for another), or once a credit asked at the live version was refused (one
        refused just before a version went live, whose groups come next, keeps it awake). The engine wakes
        itself for a version or a group: a group admitted after all costs one wake."""
        version = self.engine.policy_version
        if not self.sleeps or self.engine.asleep or not (last_group or self._refused_at == version):
            return
        seconds = await self.engine.sleep()
        if self.engine.asleep:
            self.stats.sleeps += 1
            log.debug("node %s asleep at version %d in %.3fs", self.node_id, version, seconds)
            if self.events is not None:
                after = "last_group" if last_group else "refused"  # its own groups done / none left to take
                self.events.emit("asleep", version=version, seconds=round(seconds, 4), after=after)

    async def apply_weights(self, ready: WeightsReady) -> float:
        """Load the policy of `ready.version` into the engine (generation keeps going around it)."""
        async with self._weights_lock:
            seconds = await self.engine.update_weights(ready)
        self.stats.weight_updates += 1
        if self.events is not None:
            self.events.emit("live", version=ready.version)
        log.info("policy version %d live on %s in %.2fs", ready.version, self.node_id, seconds)
        return seconds

    @property
    def stopping(self) -> bool:
        """Told to stop (by the learner, a signal or an error): what fails from now on is the stop's doing."""
        return self._stopping is not None and self._stopping.is_set()

    def stop(self, reason: str = "stop") -> None:
        """Start no new group; `run` then finishes in-flight groups within its grace period."""
        if self._stopping is not None and not self._stopping.is_set():
            log.info("node %s stopping (%s) with %d groups in flight", self.node_id, reason, len(self.in_flight))
            self._stopping.set()

    def abandon(self, reason: str = "abandon") -> None:
        """Stop now: cancel every group in flight (reported in `stats.abandoned`, credits released)."""
        self.stop(reason)
        for task in list(self.in_flight.values()):
            task.cancel()

    async def _drain(self, grace_s: float) -> None:
        """Wait for in-flight groups: all of them at a normal end, `grace_s` once stopping."""
        groups = {task: group_id for group_id, task in self.in_flight.items()}  # a done task leaves in_flight
        if not groups:
            return
        _, pending = await asyncio.wait(list(groups), timeout=grace_s if self._stopping.is_set() else None)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
            cut = sorted(groups[task] for task in pending)
            log.warning("node %s abandoned %d groups: %s", self.node_id, len(pending), cut)
