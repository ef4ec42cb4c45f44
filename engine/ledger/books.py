"""Reading a run's books, and what every ledger call shares.

`LedgerBooks` is the ledger's read side (counts, who holds which samples, the balance checks) and
its plumbing: the run's key prefix, the Lua scripts, retrying while Redis cannot be reached (`_retry`,
the one retry layer: the client from `redis_server.connect` does not retry), and exactly-once writes
(each writing call carries its own id, under which Redis keeps its reply: scripts.exactly_once).
`Ledger` (writer.py) adds the moves; `streamrl status` reads only.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
import uuid
from collections.abc import Iterable
from typing import Protocol

import msgspec
import redis

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import scripts as lua
from streamrl.engine.ledger.errors import LedgerError, gave_up
from streamrl.engine.redis_server import redact, write_refusal

log = logging.getLogger("streamrl.engine.ledger")

DROP_REASONS = (
    "stale",
    "node_lost",
    "reward_error",
    "overlong",
    "duplicate",
    "preempted",
    "rolled_back",
    "zero_variance",  # dynamic sampling: a group with no reward variance, replaced (learner/selection.py)
    "truncated",  # loss.mask_truncated: a completion cut by a length limit, kept out of the loss
    "no_gradient",  # in a step whose loss had no gradient: no update, no version (learner/train_step.py)
    "nonfinite_step",  # in a step whose every update had a non-finite gradient
    "overdue",  # held by a node silent past the group deadline: given up so the step goes on (learner/overdue.py)
)

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
        gone, parts = self.held_by_gone_nodes, []
        if gone:
            nodes = ", ".join(f"{node} {n}" for node, n in gone.items())
            parts.append(f"{sum(gone.values())} held by gone nodes ({nodes})")
        if self.held_by_live_nodes:
            parts.append(f"{self.held_by_live_nodes} by live nodes")
        if self.received:
            parts.append(f"{self.received} received by the learner, never trained")
        if self.orphaned:
            parts.append(f"{self.orphaned} waiting for a node to re-generate them")
        return ", ".join(parts) or "none"


def retried(method):
    """Run a ledger method (reads and idempotent writes) under `Ledger._retry`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        return self._retry(lambda: method(self, *args, **kwargs), method.__name__)

    return wrapper


class LedgerBooks:
    """A run's books in Redis, read-only, under the key prefix `streamrl:{run}:` (runs may share a server)."""

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

    # ---- plumbing: scripts, retries, exactly-once writes -----------------------------------------

    def _call(self, name: str, *args):
        keys = [self._call_id()] if name in _WRITERS else []  # one id for every retry of this call
        try:
            return self._retry(lambda: self._scripts[name](keys=keys, args=[self.prefix, *args]), name)
        except redis.ResponseError as e:
            raise LedgerError(f"ledger of run {self.run!r}: {e}") from None

    def _call_id(self) -> str:
        return f"{self.prefix}rq:{uuid.uuid4().hex}"

    def _retry(self, attempt, what: str):
        """`attempt()`, again with doubling waits while Redis cannot be reached or refuses writes for a
        reason of its own (a full disk: `write_refusal`), for `config.retry_s`."""
        start, wait, warned, limit = time.monotonic(), 0.05, False, self.config.retry_s
        while True:
            try:
                result = attempt()
            except redis.AuthenticationError:
                raise
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as e:
                refusal = write_refusal(e)
                if isinstance(e, redis.ResponseError) and not refusal:
                    raise
                tried = time.monotonic() - start
                if tried >= limit:
                    raise gave_up(self.run, self.url, e, refusal, what, tried, limit) from None
                if not warned:
                    why = f"refuses writes ({refusal})" if refusal else f"unreachable ({e})"
                    log.warning("ledger: Redis at %s %s; retrying for up to %g s", self.url, why, limit)
                    warned = True
                time.sleep(min(wait, limit - tried))
                wait = min(2 * wait, 0.5)  # a refused connection costs nothing: notice the server back soon
                continue
            if warned:
                log.warning("ledger: Redis at %s answers again after %.1f s", self.url, time.monotonic() - start)
            return result

    # ---- reading the books -----------------------------------------------------------------------

    @retried
    def capacity(self) -> int | None:
        value = self.client.hget(self.prefix + "meta", "capacity")
        return None if value is None else int(value)

    @retried
    def current_version(self) -> int:
        return int(self.client.get(self.prefix + "version") or 0)

    @retried
    def version_history(self) -> list[VersionRecord]:
        raw = self.client.hgetall(self.prefix + "versions")
        return sorted((VersionRecord(int(v), **json.loads(r)) for v, r in raw.items()), key=lambda r: r.version)

    @retried
    def alive_nodes(self) -> list[str]:
        nodes = sorted(self.client.smembers(self.prefix + "nodes"))
        alive = self.client.exists(*[self.prefix + "alive:" + n for n in nodes]) if nodes else 0
        if alive == len(nodes):
            return nodes
        pipe = self.client.pipeline(transaction=False)
        for node in nodes:
            pipe.exists(self.prefix + "alive:" + node)
        return [n for n, up in zip(nodes, pipe.execute()) if up]

    @retried
    def groups_in_flight(self) -> int:
        return int(self.client.get(self.prefix + "inflight") or 0)

    @retried
    def finished(self) -> float | None:
        """When `finish_run` was called (time.time()), or None while the run goes on."""
        value = self.client.hget(self.prefix + "meta", "finished")
        return None if value is None else float(value)

    @retried
    def learner(self) -> dict[str, str]:
        """The run's learner as it announced itself (`announce_learner`): incarnation, control_addr,
        trajectory_addr, time; empty before any learner started."""
        return self.client.hgetall(self.prefix + "learner")

    @retried
    def learner_alive(self) -> bool:
        """A learner beat within `heartbeat_ttl_s` (`Ledger.learner_heartbeat`)."""
        return bool(self.client.exists(self.prefix + "learner:alive"))

    @retried
    def rollbacks(self) -> list[dict]:
        """Every `roll_back`, oldest first: {"from", "to", "samples", "time"}."""
        return [json.loads(r) for r in self.client.lrange(self.prefix + "rollbacks", 0, -1)]

    @retried
    def record(self, sample_id: str) -> dict[str, str]:
        """The sample's stored fields (empty when the ledger never saw it)."""
        return self.client.hgetall(self.prefix + "s:" + sample_id)

    @retried
    def group(self, group_id: str) -> dict[str, str]:
        """The group's stored fields: node, n, open (empty once every sample is resolved)."""
        return self.client.hgetall(self.prefix + "g:" + group_id)

    @retried
    def counts(self) -> Counts:
        raw = {k: int(v) for k, v in self.client.hgetall(self.prefix + "counts").items()}
        reasons = {k.removeprefix("dropped:"): v for k, v in raw.items() if k.startswith("dropped:") and v}
        return Counts(
            **{f: raw.get(f, 0) for f in Counts.__struct_fields__ if f != "dropped_by_reason"},
            dropped_by_reason=dict(sorted(reasons.items())),
        )

    @retried
    def in_flight(self) -> InFlight:
        """Who holds the samples in flight, in one consistent snapshot (a read-only script)."""
        out = self._call("IN_FLIGHT")
        by_node = {node: int(n) for node, n in zip(out[2::3], out[4::3])}
        alive = [node for node, up in zip(out[2::3], out[3::3]) if up]
        return InFlight(by_node=by_node, alive=alive, received=int(out[0]), orphaned=int(out[1]))

    @retried
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

    @retried
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


def _url_of(client: redis.Redis) -> str:
    """The client's server as a URL, password redacted (for errors: the ledger is given a client, not a URL)."""
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}"
    scheme = "rediss" if issubclass(client.connection_pool.connection_class, redis.SSLConnection) else "redis"
    auth = f"{kw.get('username') or ''}:{kw['password']}@" if kw.get("password") else ""
    return redact(f"{scheme}://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}")


def check_reason(reason: str) -> str:
    if not _REASON.match(reason):
        raise ValueError(
            f"drop reason {reason!r}: use lowercase letters, digits and '_' (e.g. {', '.join(DROP_REASONS)})"
        )
    return reason


def _tally_states(client: redis.Redis, keys: Iterable[str], states: dict[str, int]) -> None:
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hget(key, "state")
    for state in pipe.execute():
        states[state] = states.get(state, 0) + 1
