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

Redis loss: every call retries a dropped connection with backoff for `ledger.retry_s` (the server
restarting from its append-only file), then raises `LedgerUnavailableError` naming the server.
A retried write cannot apply twice or answer differently: each writing call carries its own id,
under which Redis keeps its reply (ledger_scripts.exactly_once).

A run's end: the learner calls `finish_run()`; from then on a sample still in flight is an error
of the books (`check`), not a sample on its way.
"""

from __future__ import annotations

import functools
import json
import logging
import pathlib
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec
import redis

from streamrl.engine import ledger_scripts as lua
from streamrl.engine.config import LedgerConfig
from streamrl.engine.redis_server import RedisServer, connect, redact

log = logging.getLogger(__name__)

DROP_REASONS = ("stale", "node_lost", "reward_error", "overlong", "duplicate", "preempted", "rolled_back")
_REASON = re.compile(r"^[a-z][a-z0-9_]*$")
_WRITERS = (
    "TAKE_CREDIT",
    "TRANSITION",
    "REAP",
    "LEAVE",
    "CLAIM_ORPHAN",
    "PUBLISH_VERSION",
    "ROLL_BACK",
    "DROP_RECEIVED",
)
_READERS = ("IN_FLIGHT",)


class LedgerError(RuntimeError):
    """A ledger call the run's state does not allow (node not alive, run not set up, ...)."""


class LedgerUnavailableError(RuntimeError):
    """Redis did not answer within `ledger.retry_s`; the message names the server and how long it was tried."""


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

    @property
    def max_version(self) -> int: ...


class Received(msgspec.Struct):
    """What `receive()` made of a batch: train `fresh`; the others are resolved already."""

    fresh: list  # the samples to train, in arrival order
    stale: list[str]  # dropped as stale
    reward_errors: list[str]  # dropped as reward_error (reward None)
    rejected: list[tuple[str, str]]  # (sample_id, its state): a duplicate, a late arrival, an unknown id
    rolled_back: list[str] = []  # dropped as rolled_back: a token from a policy newer than the current one


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


class InFlight(msgspec.Struct):
    """Who holds the samples in flight (one snapshot): `in_flight == held + received + orphaned`."""

    by_node: dict[str, int] = {}  # admitted or generated samples, per node that holds them
    alive: list[str] = []  # the nodes of `by_node` with a live heartbeat
    received: int = 0  # taken in by the learner, not trained yet
    orphaned: int = 0  # a lost node's, waiting for another node (on_node_lost = readmit)

    @property
    def held_by_live_nodes(self) -> int:
        return sum(n for node, n in self.by_node.items() if node in self.alive)

    @property
    def held_by_gone_nodes(self) -> dict[str, int]:
        return {node: n for node, n in self.by_node.items() if node not in self.alive}

    @property
    def total(self) -> int:
        return sum(self.by_node.values()) + self.received + self.orphaned

    def describe(self) -> str:
        """E.g. `16 held by gone nodes (node-b 16), 3 by live nodes, 2 received by the learner`."""
        gone = self.held_by_gone_nodes
        parts = [f"{sum(gone.values())} held by gone nodes ({', '.join(f'{k} {v}' for k, v in gone.items())})"] * bool(
            gone
        )
        parts += [f"{self.held_by_live_nodes} by live nodes"] * bool(self.held_by_live_nodes)
        parts += [f"{self.received} received by the learner, never trained"] * bool(self.received)
        parts += [f"{self.orphaned} waiting for a node to re-generate them"] * bool(self.orphaned)
        return ", ".join(parts) or "none"


def _retried(method):
    """Run a ledger method (reads and idempotent writes) under `Ledger._retry`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return self._retry(lambda: method(self, *args, **kwargs), method.__name__)

    return wrapper


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
        self.url = _url_of(client)
        self._scripts = {name: client.register_script(lua.exactly_once(getattr(lua, name))) for name in _WRITERS}
        self._scripts.update({name: client.register_script(getattr(lua, name)) for name in _READERS})

    def _call(self, name: str, *args):
        keys = [self._call_id()] if name in _WRITERS else []  # one id for every retry of this call
        try:
            return self._retry(lambda: self._scripts[name](keys=keys, args=[self.prefix, *args]), name)
        except redis.ResponseError as e:
            raise LedgerError(f"ledger of run {self.run!r}: {e}") from None

    def _call_id(self) -> str:
        return f"{self.prefix}rq:{uuid.uuid4().hex}"

    def _retry(self, attempt, what: str):
        """`attempt()`, again with doubling waits while Redis cannot be reached, for `config.retry_s`."""
        start, wait, warned = time.monotonic(), 0.05, False
        while True:
            try:
                result = attempt()
            except redis.AuthenticationError:
                raise
            except (redis.ConnectionError, redis.TimeoutError) as e:
                tried = time.monotonic() - start
                if tried >= self.config.retry_s:
                    raise LedgerUnavailableError(
                        f"ledger of run {self.run!r}: Redis at {self.url} did not answer for {tried:.1f} s "
                        f"({what}: {type(e).__name__}: {e}); the ledger stays in Redis as it was; start the "
                        f"server again (same port and folder) and resume, or raise ledger.retry_s = "
                        f"{self.config.retry_s:g} to wait longer"
                    ) from None
                if not warned:
                    log.warning(
                        "ledger: Redis at %s unreachable (%s); retrying for up to %g s",
                        self.url,
                        e,
                        self.config.retry_s,
                    )
                    warned = True
                time.sleep(min(wait, self.config.retry_s - tried))
                wait = min(2 * wait, 2.0)
                continue
            if warned:
                log.warning("ledger: Redis at %s answers again after %.1f s", self.url, time.monotonic() - start)
            return result

    # ---- run and versions -------------------------------------------------------------------

    @_retried
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

    @_retried
    def capacity(self) -> int | None:
        value = self.client.hget(self.prefix + "meta", "capacity")
        return None if value is None else int(value)

    def publish_version(self, version: int, step: int) -> None:
        """The learner's new policy version (after step `step`); refuses to go backwards."""
        record = json.dumps({"step": step, "time": time.time()})
        self._call("PUBLISH_VERSION", version, record)

    @_retried
    def current_version(self) -> int:
        return int(self.client.get(self.prefix + "version") or 0)

    @_retried
    def version_history(self) -> list[VersionRecord]:
        raw = self.client.hgetall(self.prefix + "versions")
        return sorted((VersionRecord(int(v), **json.loads(r)) for v, r in raw.items()), key=lambda r: r.version)

    # ---- nodes ------------------------------------------------------------------------------

    @_retried
    def heartbeat(self, node_id: str) -> None:
        """The node is alive for another `heartbeat_ttl_s`; call it well within that period."""
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.prefix + "alive:" + node_id, time.time(), px=int(self.config.heartbeat_ttl_s * 1000))
        pipe.sadd(self.prefix + "nodes", node_id)
        pipe.srem(self.prefix + "lost", node_id)
        pipe.execute()

    @_retried
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
        return self.resolve_node(node_id, reason)

    def resolve_node(self, node_id: str, reason: str = "node_lost") -> int:
        """Drop, as `reason`, the samples node `node_id` holds and has not delivered (admitted or
        generated); how many. For whoever knows the node is gone (the launcher that stopped it, the
        learner at the end of a run) without waiting for its heartbeat to expire: the node counts
        as lost from now on, and its samples are no longer its to deliver."""
        return self._call("LEAVE", node_id, _check_reason(reason), time.time())

    # ---- a run's end and a learner's resume ---------------------------------------------------

    @_retried
    def finish_run(self) -> None:
        """The run has ended (the learner calls it last): a sample still in flight is an error from now on."""
        self.client.hset(self.prefix + "meta", "finished", time.time())

    @_retried
    def finished(self) -> float | None:
        """When `finish_run` was called (time.time()), or None while the run goes on."""
        value = self.client.hget(self.prefix + "meta", "finished")
        return None if value is None else float(value)

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

    @_retried
    def rollbacks(self) -> list[dict]:
        """Every `roll_back`, oldest first: {"from", "to", "samples", "time"}."""
        return [json.loads(r) for r in self.client.lrange(self.prefix + "rollbacks", 0, -1)]

    def drop_received(self, reason: str = "preempted") -> int:
        """Drop every `received` sample as `reason`; how many. A new learner calls it at start: what
        the previous one took in and never trained will not be delivered again."""
        return self._call("DROP_RECEIVED", _check_reason(reason), time.time())

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

    @_retried
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
        record, now, keys = json.dumps({"step": step, "time": time.time()}), time.time(), self._call_id()

        def attempt():
            pipe = self.client.pipeline(transaction=False)
            if trained_ids:
                args = [self.prefix, "trained", now, 1, *trained_ids]
                self._scripts["TRANSITION"](keys=[keys + ":t"], args=args, client=pipe)
            self._scripts["PUBLISH_VERSION"](keys=[keys + ":v"], args=[self.prefix, version, record], client=pipe)
            return _execute(pipe, self.run)

        results = self._retry(attempt, "commit_step")
        return [r == 1 for r in results[0]] if trained_ids else []

    def drop(self, sample_ids: Sequence[str], reason: str) -> list[bool]:
        return [r == "" for r in self.transition(sample_ids, "dropped:" + _check_reason(reason))]

    def receive(self, samples: Sequence[GeneratedSample], current_version: int) -> Received:
        """Learner side, one round trip: mark a batch received, dropping stale ones and failed rewards.

        Staleness is measured on `min_version` (the oldest policy any token came from).
        """
        by_target: dict[str, list] = {t: [] for t in _RECEIVE_TARGETS}
        for s in samples:
            if s.max_version > current_version:  # a policy rolled back (a learner resumed from a checkpoint)
                by_target["dropped:rolled_back"].append(s)
            elif is_stale(s.min_version, current_version, self.config.max_staleness):
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

    # ---- reading the books ------------------------------------------------------------------

    @_retried
    def record(self, sample_id: str) -> dict[str, str]:
        """The sample's stored fields (empty when the ledger never saw it)."""
        return self.client.hgetall(self.prefix + "s:" + sample_id)

    @_retried
    def counts(self) -> Counts:
        raw = {k: int(v) for k, v in self.client.hgetall(self.prefix + "counts").items()}
        reasons = {k.removeprefix("dropped:"): v for k, v in raw.items() if k.startswith("dropped:") and v}
        return Counts(
            **{f: raw.get(f, 0) for f in Counts.__struct_fields__ if f != "dropped_by_reason"},
            dropped_by_reason=dict(sorted(reasons.items())),
        )

    @_retried
    def in_flight(self) -> InFlight:
        """Who holds the samples in flight, in one consistent snapshot (a read-only script)."""
        out = self._call("IN_FLIGHT")
        by_node = {node: int(n) for node, n in zip(out[2::3], out[4::3])}
        alive = [node for node, up in zip(out[2::3], out[3::3]) if up]
        return InFlight(by_node=by_node, alive=alive, received=int(out[0]), orphaned=int(out[1]))

    def staleness_histogram(self) -> dict[int, int]:
        """Versions between a trained sample's oldest token and the policy that trained on it -> samples."""
        return dict(sorted((int(k), int(v)) for k, v in self.client.hgetall(self.prefix + "lag").items()))

    def check(self, deep: bool = False) -> list[str]:
        """Why the books do not balance (empty when they do); `deep` also recounts every record."""
        counts = self.counts()
        errors = counts.balance_errors()
        if counts.in_flight and self.finished() is not None:
            errors.append(
                f"the run has finished with {counts.in_flight} samples neither trained nor dropped: "
                f"{self.in_flight().describe()}"
            )
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
            held = self.in_flight()
            if held.total != counts.in_flight:
                errors.append(f"in flight by holder {held.total} ({held.describe()}) != counters {counts.in_flight}")
        return errors

    @_retried
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


_RECEIVE_TARGETS = ("received", "dropped:stale", "dropped:reward_error", "dropped:rolled_back")


def _url_of(client: redis.Redis) -> str:
    """The client's server as a URL, password redacted (for errors: the ledger is given a client, not a URL)."""
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    scheme = "rediss" if issubclass(client.connection_pool.connection_class, redis.SSLConnection) else "redis"
    auth = f"{kw.get('username') or ''}:{kw['password']}@" if kw.get("password") else ""
    return redact(f"{scheme}://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}")


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
