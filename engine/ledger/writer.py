"""The Redis ledger: policy versions, admission credits, node membership and every sample's fate.

A sample moves `admitted -> generated -> received -> trained`, or to `dropped:<reason>` from any
of the first three; every move is one atomic Lua script over a batch of samples, and one that is
not legal from the sample's state is refused (so a sample delivered twice is trained once).

Credits bound staleness. A node takes one credit per group before generating it; the group's
samples are admitted then, as `{group_id}:{i}`. The credit returns when every sample of the group
is resolved (trained or dropped), so at most `(max_staleness + 1) * groups_per_step` groups are
in flight however many nodes join. The staleness bound is `LedgerConfig.staleness_bound`, read by
the admission script and the Python checks alike; its docstring says which check guarantees it.
A node that stops beating is reaped by the learner: its samples not yet received are dropped as
`node_lost`, or re-admitted for another node (`on_node_lost`).

The learner's hot path costs two round trips per step, `receive()` and `commit_step()`, plus
`reap_lost_nodes()` (one) as often as it likes to check on nodes.

Redis loss: every call retries a dropped connection with backoff for `ledger.retry_s` (the server
restarting from its append-only file), then raises `LedgerUnavailableError` naming the server. A
Redis that answers but refuses writes (a full disk: MISCONF; OOM; READONLY) is retried alike, then
`LedgerUnwritableError` (a `LedgerUnavailableError`) names its answer and the fix.
A retried write cannot apply twice or answer differently: each writing call carries its own id,
under which Redis keeps its reply (scripts.exactly_once).

A run's end: the learner calls `finish_run()`; from then on a sample still in flight is an error
of the books (`check`), not a sample on its way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence

import redis

from streamrl.engine.ledger.books import (
    DROP_REASONS,
    Counts,
    GeneratedSample,
    InFlight,
    LedgerBooks,
    Orphan,
    Received,
    VersionRecord,
    check_reason,
    is_stale,
    retried,
    sample_ids,
)
from streamrl.engine.ledger.errors import LedgerError, LedgerUnavailableError, LedgerUnwritableError
from streamrl.engine.redis_server import write_refusal

__all__ = [
    "DROP_REASONS",
    "Counts",
    "GeneratedSample",
    "InFlight",
    "Ledger",
    "LedgerError",
    "LedgerUnavailableError",
    "LedgerUnwritableError",
    "Orphan",
    "Received",
    "VersionRecord",
    "is_stale",
    "sample_ids",
]


class Ledger(LedgerBooks):
    """One run's books in Redis, read (LedgerBooks) and moved: credits, nodes, versions, every sample's fate."""

    # ---- run and versions ------------------------------------------------------------------------

    @retried
    def init_run(self, groups_per_step: int, mode: str = "async", steps_left: int = -1) -> int:
        """Record the admission rules (the learner calls it at start): at most `LedgerConfig.admitted_groups`
        groups in flight (`(max_staleness + 1) * groups_per_step`); a group only when it can be trained within
        max_staleness of the weights that generate it (mode "async") or, in mode "sync", one step's groups at
        a time with the learner's newest weights; never more groups than `steps_left` steps train (-1: no
        end). A learner resuming a run that had finished takes it up again: it is no longer finished."""
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step = {groups_per_step}: must be >= 1")
        if mode not in ("async", "sync", "auto"):  # auto: what no preflight resolved (off a shared GPU) runs async
            raise ValueError(f"mode = {mode!r}: 'async', 'sync' or 'auto'")
        bound, capacity = self.config.staleness_bound, self.config.admitted_groups(groups_per_step, mode)
        self.client.hset(
            self.prefix + "meta",
            mapping={
                "capacity": capacity,
                "max_staleness": bound,
                "groups_per_step": groups_per_step,
                "mode": mode,
                "steps_left": steps_left,
            },
        )
        self.client.hdel(self.prefix + "meta", "finished")
        self.client.set(self.prefix + "held", 0)  # a learner before this one held places for its own steps
        if self.client.get(self.prefix + "version") is None:
            self.publish_version(0, step=0)
        return capacity

    def publish_version(self, version: int, step: int) -> None:
        """The learner's new policy version (after step `step`); refuses to go backwards."""
        record = json.dumps({"step": step, "time": time.time()})
        self._call("PUBLISH_VERSION", version, record)

    # ---- nodes -----------------------------------------------------------------------------------

    @retried
    def heartbeat(self, node_id: str) -> None:
        """The node is alive for another `heartbeat_ttl_s`; call it well within that period."""
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.prefix + "alive:" + node_id, time.time(), px=int(self.config.heartbeat_ttl_s * 1000))
        pipe.sadd(self.prefix + "nodes", node_id)
        pipe.srem(self.prefix + "lost", node_id)
        pipe.execute()

    def reap_lost_nodes(self) -> dict[str, int]:
        """Resolve the samples of every node whose heartbeat expired (one round trip); node -> samples.
        None for `heartbeat_ttl_s` after it first sees a restarted Redis: heartbeats that expired while
        the server was down are no news of the nodes."""
        out = self._call("REAP", self.config.on_node_lost, time.time(), self.config.heartbeat_ttl_s)
        return dict(zip(out[::2], out[1::2]))

    def leave(self, node_id: str, reason: str = "preempted") -> int:
        """A node leaving cleanly: its samples not yet received are dropped with `reason`."""
        return self.resolve_node(node_id, reason)

    def resolve_node(self, node_id: str, reason: str = "node_lost") -> int:
        """Drop, as `reason`, the samples node `node_id` holds and has not delivered (admitted or
        generated); how many. For whoever knows the node is gone (the launcher that stopped it, the
        learner at the end of a run) without waiting for its heartbeat to expire: the node counts
        as lost from now on, and its samples are no longer its to deliver."""
        return self._call("LEAVE", node_id, check_reason(reason), time.time())

    @retried
    def announce_learner(self, incarnation: str, control_addr: str, trajectory_addr: str) -> None:
        """A learner (re)started for this run: where nodes reach it now (`learner()` reads it). Nodes of
        an earlier incarnation notice the new one here and register with it."""
        record = {"incarnation": incarnation, "control_addr": control_addr, "trajectory_addr": trajectory_addr}
        self.client.hset(self.prefix + "learner", mapping={**record, "time": time.time()})

    @retried
    def learner_heartbeat(self, incarnation: str) -> None:
        """Learner `incarnation` is alive for another `heartbeat_ttl_s` (`learner_alive`); `learner()["beat"]`
        says when it last beat."""
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.prefix + "learner:alive", incarnation, px=int(self.config.heartbeat_ttl_s * 1000))
        pipe.hset(self.prefix + "learner", "beat", time.time())
        _execute(pipe, self.run)

    # ---- a run's end and a learner's resume ------------------------------------------------------

    @retried
    def finish_run(self) -> None:
        """The run has ended (the learner calls it last): a sample still in flight is an error from now on."""
        self.client.hset(self.prefix + "meta", "finished", time.time())

    def roll_back(self, from_version: int) -> int:
        """A learner resumed from a checkpoint of policy `from_version` makes the books match it.

        Samples trained by `from_version` or a later policy (the steps after the checkpoint, which
        its weights never saw) and in-flight samples generated by a later policy become
        `dropped:rolled_back` (trained -> dropped, their staleness out of the histogram); the
        version is set back to `from_version` and the later versions' records are removed (the
        rollback itself is kept, see `rollbacks()`). One atomic script; returns the samples rolled back.
        """
        if from_version < 0:
            raise ValueError(f"from_version = {from_version}: must be >= 0")
        return self._call("ROLL_BACK", from_version, time.time())

    def drop_received(self, reason: str = "preempted") -> int:
        """Drop every `received` sample as `reason`; how many. A new learner calls it at start: what
        the previous one took in and never trained will not be delivered again."""
        return self._call("DROP_RECEIVED", check_reason(reason), time.time())

    # ---- credits ---------------------------------------------------------------------------------

    def take_credit(
        self, node_id: str, group_id: str, group_size: int, prompt: str = "", node_version: int = -1
    ) -> list[str] | None:
        """Take a credit for a group and admit its samples; their ids, or None when no credit is free.

        `node_version`: the policy version the node would generate the group with; the admission rules
        of `init_run` weigh it (-1: not known, only the capacity and the end of the run apply).
        `prompt` is an opaque reference (e.g. a data row) handed to whoever re-generates the group
        if this node is lost and `on_node_lost = "readmit"`.
        """
        if group_size < 1:
            raise ValueError(f"group_size = {group_size}: must be >= 1")
        if ":" in group_id or not group_id:
            raise ValueError(f"group_id = {group_id!r}: must be non-empty and without ':' (sample ids add ':i')")
        taken = self._call("TAKE_CREDIT", node_id, group_id, group_size, prompt, time.time(), node_version)
        return sample_ids(group_id, group_size) if taken == 1 else None

    @retried
    def hold_credits(self, count: int) -> None:
        """Learner side: `count` credits stay taken for the places of groups the learner gave up (their node
        is gone), until the steps they were admitted for end (`commit_step`/`skip_step`'s `held`). Admission
        counts them as groups ahead, so a group admitted in a place's stead is trained after that step,
        never in it: the step trains without the lost group instead of waiting for one made from scratch.
        The learner owns the count and writes it whole (a retry writes the same)."""
        self.client.set(self.prefix + "held", max(0, count))

    def oldest_open_groups(self, count: int) -> list[str]:
        """The `count` groups admitted first that are not resolved yet (a batch trains in this order)."""
        return self._retry(lambda: self.client.zrange(self.prefix + "adm", 0, count - 1), "oldest_open_groups")

    def claim_orphan(self, node_id: str) -> Orphan | None:
        """The oldest group a lost node left behind (readmit mode), now this node's; None if none."""
        out = self._call("CLAIM_ORPHAN", node_id)
        return Orphan(out[0], out[1], list(out[2:])) if out else None

    # ---- sample transitions ----------------------------------------------------------------------

    def transition(self, sample_ids: Sequence[str], target: str, extra: Sequence[Sequence] = ()) -> list[str]:
        """Move samples to `target` atomically; per sample '' when moved, else the state that refused it."""
        if not sample_ids:
            return []
        args = _interleave(sample_ids, extra)
        stride = 1 + (len(extra[0]) if extra else 0)
        out = self._call("TRANSITION", target, time.time(), stride, *args)
        return ["" if r == 1 else (r or "unknown") for r in out]

    def mark_generated(self, samples: Sequence[GeneratedSample]) -> list[bool]:
        """Node side, before sending: the samples exist, sampled by these policy versions.

        False for a sample not `admitted` to this node (`node_id`): e.g. a node reaped as lost
        whose group went to another node."""
        ids = [s.sample_id for s in samples]
        extra = [(s.policy_version, s.min_version, s.node_id) for s in samples]
        return [r == "" for r in self.transition(ids, "generated", extra)]

    def mark_received(self, sample_ids: Sequence[str]) -> list[bool]:
        """False for a sample that was not `generated`: a duplicate, a late arrival or an unknown id."""
        return [r == "" for r in self.transition(sample_ids, "received")]

    def mark_trained(self, sample_ids: Sequence[str]) -> list[bool]:
        """True for the samples that moved to `trained` now; a sample is trained at most once."""
        return [r == "" for r in self.transition(sample_ids, "trained")]

    def drop_stale(self, samples: Sequence[GeneratedSample], current_version: int) -> list:
        """Learner side, for samples received earlier and consumed now by a step that trains at
        `current_version`: drop the ones gone stale since, as `stale`; the rest, to train. The check
        that guarantees the staleness bound (`LedgerConfig.staleness_bound`)."""
        bound = self.config.staleness_bound
        stale = [s.sample_id for s in samples if is_stale(s.min_version, current_version, bound)]
        if stale:
            self.drop(stale, "stale")
        gone = set(stale)
        return [s for s in samples if s.sample_id not in gone]

    def commit_step(
        self,
        trained_ids: Sequence[str],
        version: int,
        step: int,
        steps_left: int | None = None,
        dropped: Mapping[str, Sequence[str]] | None = None,
        held: int | None = None,
    ) -> list[bool]:
        """Learner side, one round trip after an optimizer step: mark the batch trained (staleness
        measured against the version that trained it), then publish the new `version`; with it how many
        steps are left (for admission) and the step's samples that left the batch (`dropped`: reason ->
        ids, e.g. truncated completions kept out of the loss); `held`: the credits still held once the step
        ended (`hold_credits`)."""
        record, now, keys = json.dumps({"step": step, "time": time.time()}), time.time(), self._call_id()

        def attempt():
            pipe = self.client.pipeline(transaction=False)
            self._end_step(pipe, keys, now, steps_left, dropped or {}, held)
            if trained_ids:
                args = [self.prefix, "trained", now, 1, *trained_ids]
                self._scripts["TRANSITION"](keys=[keys + ":t"], args=args, client=pipe)
            self._scripts["PUBLISH_VERSION"](keys=[keys + ":v"], args=[self.prefix, version, record], client=pipe)
            return _execute(pipe, self.run)

        results = self._retry(attempt, "commit_step")
        at = (steps_left is not None) + (held is not None) + sum(1 for ids in (dropped or {}).values() if ids)
        return [r == 1 for r in results[at]] if trained_ids else []

    def skip_step(
        self, dropped: Mapping[str, Sequence[str]], steps_left: int | None = None, held: int | None = None
    ) -> None:
        """Learner side, one round trip after a step that took no optimizer update: its samples are dropped
        (`dropped`: reason -> ids, e.g. no_gradient; no weights contain them and the version does not move)
        and, as `commit_step` records it, how many steps are left, so admission does not count the step as
        still to come."""
        now, keys = time.time(), self._call_id()

        def attempt():
            pipe = self.client.pipeline(transaction=False)
            self._end_step(pipe, keys, now, steps_left, dropped, held)
            return _execute(pipe, self.run)

        self._retry(attempt, "skip_step")

    def _end_step(
        self,
        pipe,
        keys: str,
        now: float,
        steps_left: int | None,
        dropped: Mapping[str, Sequence[str]],
        held: int | None,
    ):
        """Queue a step's end on `pipe`: the steps left and the credits still held first, then the drops. In that
        order a credit the drops return (a group resolved whole) is weighed against the steps now left, never
        the step just done."""
        if steps_left is not None:
            pipe.hset(self.prefix + "meta", "steps_left", steps_left)
        if held is not None:
            pipe.set(self.prefix + "held", max(0, held))
        for reason, ids in dropped.items():
            if ids:
                args = [self.prefix, "dropped:" + check_reason(reason), now, 1, *ids]
                self._scripts["TRANSITION"](keys=[f"{keys}:d:{reason}"], args=args, client=pipe)

    def drop(self, sample_ids: Sequence[str], reason: str) -> list[bool]:
        return [r == "" for r in self.transition(sample_ids, "dropped:" + check_reason(reason))]

    def receive(self, samples: Sequence[GeneratedSample], current_version: int) -> Received:
        """Learner side, one round trip: mark a batch received, dropping stale ones and failed rewards.

        Staleness is measured on `min_version` (the oldest policy any token came from).
        """
        by_target: dict[str, list] = {t: [] for t in _RECEIVE_TARGETS}
        for s in samples:
            if s.max_version > current_version:  # a policy rolled back (a learner resumed from a checkpoint)
                by_target["dropped:rolled_back"].append(s)
            elif is_stale(s.min_version, current_version, self.config.staleness_bound):  # saves holding them
                by_target["dropped:stale"].append(s)
            else:
                by_target["received" if s.reward is not None else "dropped:reward_error"].append(s)
        now, key = time.time(), self._call_id()

        def attempt():
            pipe = self.client.pipeline(transaction=False)
            for target, group in by_target.items():
                if group:
                    args = [self.prefix, target, now, 1, *(s.sample_id for s in group)]
                    self._scripts["TRANSITION"](keys=[f"{key}:{target}"], args=args, client=pipe)
            return _execute(pipe, self.run)

        results = iter(self._retry(attempt, "receive"))
        moved: dict[str, list] = {target: [] for target in by_target}
        rejected = []
        for target, group in by_target.items():
            for s, r in zip(group, next(results) if group else ()):
                if r == 1:
                    moved[target].append(s)
                else:
                    rejected.append((s.sample_id, r or "unknown"))
        return Received(
            fresh=moved["received"],
            stale=[s.sample_id for s in moved["dropped:stale"]],
            reward_errors=[s.sample_id for s in moved["dropped:reward_error"]],
            rejected=rejected,
            rolled_back=[s.sample_id for s in moved["dropped:rolled_back"]],
        )


_RECEIVE_TARGETS = ("received", "dropped:stale", "dropped:reward_error", "dropped:rolled_back")


def _interleave(ids: Sequence[str], extra: Sequence[Sequence]) -> list:
    if not extra:
        return list(ids)
    if len(extra) != len(ids):
        raise ValueError(f"{len(extra)} extra rows for {len(ids)} samples")
    return [v for i, row in zip(ids, extra) for v in (i, *row)]


def _execute(pipe, run: str) -> list:
    try:
        return pipe.execute()
    except redis.ResponseError as e:
        if write_refusal(e):
            raise  # Redis cannot write: retried, then LedgerUnwritableError (LedgerBooks._retry)
        raise LedgerError(f"ledger of run {run!r}: {e}") from None
