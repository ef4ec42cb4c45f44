"""The Redis ledger: policy versions, admission credits, node membership and every sample's fate.

A sample moves `admitted -> generated -> received -> trained`, or to `dropped:<reason>` from any
of the first three; every move is one atomic Lua script over a batch of samples, and one that is
not legal from the sample's state is refused (so a sample delivered twice is trained once).

Credits bound staleness. A node takes one credit per group before generating it; the group's
samples are admitted then, as `{group_id}:{i}`. The credit returns when every sample of the group
is resolved (trained or dropped), so at most `(max_staleness + 1) * groups_per_step` groups are
in flight however many nodes join. A node that stops beating is reaped by the learner: its samples
not yet received are dropped as `node_lost`, or re-admitted for another node (`on_node_lost`).

The learner's hot path costs two round trips per step, `receive()` and `commit_step()`, plus
`reap_lost_nodes()` (one) as often as it likes to check on nodes.
"""

from __future__ import annotations

import json
import pathlib
import re
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec
import redis

from streamrl.engine import ledger_scripts as lua
from streamrl.engine.config import LedgerConfig
from streamrl.engine.redis_server import RedisServer, connect

DROP_REASONS = ("stale", "node_lost", "reward_error", "overlong", "duplicate", "preempted")
_REASON = re.compile(r"^[a-z][a-z0-9_]*$")


class LedgerError(RuntimeError):
    """A ledger call the run's state does not allow (node not alive, run not set up, ...)."""


def is_stale(sample_version: int, current_version: int, max_staleness: int) -> bool:
    """True when the sample's policy is more than `max_staleness` versions behind the current one."""
    return current_version - sample_version > max_staleness


def sample_ids(group_id: str, group_size: int) -> list[str]:
    """The ids of a group's samples, as the ledger admits them."""
    return [f"{group_id}:{i}" for i in range(group_size)]


class GeneratedSample(Protocol):
    """What `mark_generated` / `receive` read from a sample (`messages.Trajectory` has it all)."""

    sample_id: str
    node_id: str
    policy_version: int
    reward: float | None

    @property
    def min_version(self) -> int: ...


class Received(msgspec.Struct):
    """What `receive()` made of a batch: train `fresh`; the others are resolved already."""

    fresh: list  # the samples to train, in arrival order
    stale: list[str]  # dropped as stale
    reward_errors: list[str]  # dropped as reward_error (reward None)
    rejected: list[tuple[str, str]]  # (sample_id, its state): a duplicate, a late arrival, an unknown id


class Orphan(msgspec.Struct):
    """A lost node's group, handed to another node to generate `sample_ids` again."""

    group_id: str
    prompt: str
    sample_ids: list[str]


class VersionRecord(msgspec.Struct):
    version: int
    step: int
    time: float


class Counts(msgspec.Struct):
    """The books: `total == trained + dropped + in_flight` when they balance."""

    total: int = 0
    admitted: int = 0
    generated: int = 0
    received: int = 0
    trained: int = 0
    dropped: int = 0
    dropped_by_reason: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return self.admitted + self.generated + self.received

    def balance_errors(self) -> list[str]:
        errors = []
        if self.total != self.trained + self.dropped + self.in_flight:
            errors.append(
                f"total {self.total} != trained {self.trained} + dropped {self.dropped} + in flight {self.in_flight}"
            )
        if self.dropped != sum(self.dropped_by_reason.values()):
            errors.append(f"dropped {self.dropped} != sum over reasons {sum(self.dropped_by_reason.values())}")
        negative = [f for f in ("admitted", "generated", "received") if getattr(self, f) < 0]
        if negative:
            errors.append(f"negative counts: {', '.join(negative)}")
        return errors


class Ledger:
    """One run's books in Redis, under the key prefix `streamrl:{run}:` (runs may share a server)."""

    def __init__(self, client: redis.Redis, run: str, config: LedgerConfig | None = None):
        if not run or not re.match(r"^[A-Za-z0-9_.-]+$", run):
            raise ValueError(f"run = {run!r}: a run id is letters, digits, '_', '.', '-'")
        if not client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the ledger needs a client made with decode_responses=True (use redis_server.connect)")
        self.client = client
        self.run = run
        self.config = config or LedgerConfig()
        self.prefix = f"streamrl:{run}:"
        self._scripts = {
            name: client.register_script(getattr(lua, name))
            for name in ("TAKE_CREDIT", "TRANSITION", "REAP", "LEAVE", "CLAIM_ORPHAN", "PUBLISH_VERSION")
        }

    def _call(self, name: str, *args):
        try:
            return self._scripts[name](args=[self.prefix, *args])
        except redis.ResponseError as e:
            raise LedgerError(f"ledger of run {self.run!r}: {e}") from None

    # ---- run and versions -------------------------------------------------------------------

    def init_run(self, groups_per_step: int) -> int:
        """Record the credit capacity `(max_staleness + 1) * groups_per_step`; the learner calls it at start."""
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step = {groups_per_step}: must be >= 1")
        capacity = (self.config.max_staleness + 1) * groups_per_step
        self.client.hset(
            self.prefix + "meta",
            mapping={
                "capacity": capacity,
                "max_staleness": self.config.max_staleness,
                "groups_per_step": groups_per_step,
            },
        )
        if self.client.get(self.prefix + "version") is None:
            self.publish_version(0, step=0)
        return capacity

    def capacity(self) -> int | None:
        value = self.client.hget(self.prefix + "meta", "capacity")
        return None if value is None else int(value)

    def publish_version(self, version: int, step: int) -> None:
        """The learner's new policy version (after step `step`); refuses to go backwards."""
        record = json.dumps({"step": step, "time": time.time()})
        self._call("PUBLISH_VERSION", version, record)

    def current_version(self) -> int:
        return int(self.client.get(self.prefix + "version") or 0)

    def version_history(self) -> list[VersionRecord]:
        raw = self.client.hgetall(self.prefix + "versions")
        return sorted((VersionRecord(int(v), **json.loads(r)) for v, r in raw.items()), key=lambda r: r.version)

    # ---- nodes ------------------------------------------------------------------------------

    def heartbeat(self, node_id: str) -> None:
        """The node is alive for another `heartbeat_ttl_s`; call it well within that period."""
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.prefix + "alive:" + node_id, time.time(), px=int(self.config.heartbeat_ttl_s * 1000))
        pipe.sadd(self.prefix + "nodes", node_id)
        pipe.srem(self.prefix + "lost", node_id)
        pipe.execute()

    def alive_nodes(self) -> list[str]:
        nodes = sorted(self.client.smembers(self.prefix + "nodes"))
        alive = self.client.exists(*[self.prefix + "alive:" + n for n in nodes]) if nodes else 0
        if alive == len(nodes):
            return nodes
        pipe = self.client.pipeline(transaction=False)
        for node in nodes:
            pipe.exists(self.prefix + "alive:" + node)
        return [n for n, up in zip(nodes, pipe.execute()) if up]

    def reap_lost_nodes(self) -> dict[str, int]:
        """Resolve the samples of every node whose heartbeat expired (one round trip); node -> samples."""
        out = self._call("REAP", self.config.on_node_lost, time.time())
        return dict(zip(out[::2], out[1::2]))

    def leave(self, node_id: str, reason: str = "preempted") -> int:
        """A node leaving cleanly: its samples not yet received are dropped with `reason`."""
        return self._call("LEAVE", node_id, _check_reason(reason), time.time())

    # ---- credits ----------------------------------------------------------------------------

    def take_credit(self, node_id: str, group_id: str, group_size: int, prompt: str = "") -> list[str] | None:
        """Take a credit for a group and admit its samples; their ids, or None when no credit is free.

        `prompt` is an opaque reference (e.g. a data row) handed to whoever re-generates the group
        if this node is lost and `on_node_lost = "readmit"`.
        """
        if group_size < 1:
            raise ValueError(f"group_size = {group_size}: must be >= 1")
        if ":" in group_id or not group_id:
            raise ValueError(f"group_id = {group_id!r}: must be non-empty and without ':' (sample ids add ':i')")
        taken = self._call("TAKE_CREDIT", node_id, group_id, group_size, prompt, time.time())
        return sample_ids(group_id, group_size) if taken == 1 else None

    def claim_orphan(self, node_id: str) -> Orphan | None:
        """The oldest group a lost node left behind (readmit mode), now this node's; None if none."""
        out = self._call("CLAIM_ORPHAN", node_id)
        return Orphan(out[0], out[1], list(out[2:])) if out else None

    def groups_in_flight(self) -> int:
        return int(self.client.get(self.prefix + "inflight") or 0)

    # ---- sample transitions -----------------------------------------------------------------

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
        """Learner side, for samples received earlier and consumed now: drop the ones gone stale
        since, as `stale`; the rest, to train."""
        stale = [s.sample_id for s in samples if is_stale(s.min_version, current_version, self.config.max_staleness)]
        if stale:
            self.drop(stale, "stale")
        gone = set(stale)
        return [s for s in samples if s.sample_id not in gone]

    def commit_step(self, trained_ids: Sequence[str], version: int, step: int) -> list[bool]:
        """Learner side, one round trip after an optimizer step: mark the batch trained (staleness
        measured against the version that trained it), then publish the new `version`."""
        pipe = self.client.pipeline(transaction=False)
        if trained_ids:
            self._scripts["TRANSITION"](args=[self.prefix, "trained", time.time(), 1, *trained_ids], client=pipe)
        record = json.dumps({"step": step, "time": time.time()})
        self._scripts["PUBLISH_VERSION"](args=[self.prefix, version, record], client=pipe)
        results = _execute(pipe, self.run)
        return [r == 1 for r in results[0]] if trained_ids else []

    def drop(self, sample_ids: Sequence[str], reason: str) -> list[bool]:
        return [r == "" for r in self.transition(sample_ids, "dropped:" + _check_reason(reason))]

    def receive(self, samples: Sequence[GeneratedSample], current_version: int) -> Received:
        """Learner side, one round trip: mark a batch received, dropping stale ones and failed rewards.

        Staleness is measured on `min_version` (the oldest policy any token came from).
        """
        by_target: dict[str, list] = {"received": [], "dropped:stale": [], "dropped:reward_error": []}
        for s in samples:
            if is_stale(s.min_version, current_version, self.config.max_staleness):
                by_target["dropped:stale"].append(s)
            else:
                by_target["received" if s.reward is not None else "dropped:reward_error"].append(s)
        pipe = self.client.pipeline(transaction=False)
        for target, group in by_target.items():
            if group:
                args = [self.prefix, target, time.time(), 1, *(s.sample_id for s in group)]
                self._scripts["TRANSITION"](args=args, client=pipe)
        results = iter(_execute(pipe, self.run))
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
        )

    def drop_received(self, reason: str) -> int:
        """Drop every sample in state `received` (a learner that died took them in and never trained
        them: nobody delivers them again) with `reason`; how many. Scans the run's records once."""
        keys = list(self.client.scan_iter(match=self.prefix + "s:*", count=1000))
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hget(key, "state")
        states = pipe.execute() if keys else []
        ids = [key.removeprefix(self.prefix + "s:") for key, state in zip(keys, states) if state == "received"]
        return sum(self.drop(ids, reason)) if ids else 0

    # ---- reading the books ------------------------------------------------------------------

    def record(self, sample_id: str) -> dict[str, str]:
        """The sample's stored fields (empty when the ledger never saw it)."""
        return self.client.hgetall(self.prefix + "s:" + sample_id)

    def counts(self) -> Counts:
        raw = {k: int(v) for k, v in self.client.hgetall(self.prefix + "counts").items()}
        reasons = {k.removeprefix("dropped:"): v for k, v in raw.items() if k.startswith("dropped:") and v}
        return Counts(
            **{f: raw.get(f, 0) for f in Counts.__struct_fields__ if f != "dropped_by_reason"},
            dropped_by_reason=dict(sorted(reasons.items())),
        )

    def staleness_histogram(self) -> dict[int, int]:
        """Versions between a trained sample's oldest token and the policy that trained on it -> samples."""
        return dict(sorted((int(k), int(v)) for k, v in self.client.hgetall(self.prefix + "lag").items()))

    def check(self, deep: bool = False) -> list[str]:
        """Why the books do not balance (empty when they do); `deep` also recounts every record."""
        counts = self.counts()
        errors = counts.balance_errors()
        if deep:
            expected = {
                "admitted": counts.admitted,
                "generated": counts.generated,
                "received": counts.received,
                "trained": counts.trained,
                **{"dropped:" + r: n for r, n in counts.dropped_by_reason.items()},
            }
            expected = {k: v for k, v in expected.items() if v}
            found = self.audit()
            if found != expected:
                errors.append(f"sample records by state {found} != counters {expected}")
        return errors

    def audit(self) -> dict[str, int]:
        """Count every sample record's state by scanning (slow on big runs); compare with `counts()`."""
        states: dict[str, int] = {}
        batch: list[str] = []
        for key in self.client.scan_iter(match=self.prefix + "s:*", count=1000):
            batch.append(key)
            if len(batch) == 1000:
                _tally_states(self.client, batch, states)
                batch = []
        _tally_states(self.client, batch, states)
        return states


def open_ledger(config: LedgerConfig, run: str, run_dir: str | pathlib.Path) -> tuple[Ledger, RedisServer | None]:
    """The run's ledger: on `config.url`, else on an embedded server persisting in `run_dir/redis`.

    The caller owns the returned server (None for an external one) and stops it last.
    """
    if config.url:
        return Ledger(connect(config.url, config.connect_retries), run, config), None
    server = RedisServer(pathlib.Path(run_dir) / "redis")
    try:
        return Ledger(connect(server.start(), config.connect_retries), run, config), server
    except BaseException:
        server.stop()
        raise


def _check_reason(reason: str) -> str:
    if not _REASON.match(reason):
        raise ValueError(
            f"drop reason {reason!r}: use lowercase letters, digits and '_' (e.g. {', '.join(DROP_REASONS)})"
        )
    return reason


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
        raise LedgerError(f"ledger of run {run!r}: {e}") from None


def _tally_states(client: redis.Redis, keys: Iterable[str], states: dict[str, int]) -> None:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hget(key, "state")
    for state in pipe.execute():
        states[state] = states.get(state, 0) + 1
