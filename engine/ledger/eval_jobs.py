"""Evaluation jobs in the ledger's Redis, under keys of their own: never a credit, a sample record or a count
of the training books (which stay exactly balanced).

An evaluation of version v is a job the learner posts before version v goes live (`post`). The first node
live at v lays it out (`lay_out`: every source's prompts cut into chunks of `CHUNK_PROMPTS`, the prompts
asked per source); nodes live at v take chunks (`claim`, a lease of `lease_s`), generate them at exactly v
and hand in each chunk's samples (`submit`, the first result of a chunk kept). A chunk whose node died
(lease expired, no result) goes back to the queue (`requeue_lost`). The learner reads `progress`, collects
the `results` and `close`s the job as complete or incomplete; `streamrl status` reads `jobs`.

Keys under `streamrl:{run}:eval:`: `open` (set of versions), `{v}` (hash: step, state, chunks, asked:<source>),
`{v}:all` and `{v}:queue` (lists of chunk ids), `{v}:lease:{chunk}` (the node, with a TTL), `{v}:results`
(hash chunk id → an `EvalChunkResult`, JSON).
"""

from __future__ import annotations

import msgspec
import redis

CHUNK_PROMPTS = 4  # prompts per chunk: a node's swap waits for at most about this many prompts' generation

_LAY_OUT = """
if redis.call('HGET', KEYS[1], 'state') ~= 'open' or redis.call('HEXISTS', KEYS[1], 'chunks') == 1 then
  return 0
end
local chunks = tonumber(ARGV[1])
for i = 1, chunks do
  redis.call('RPUSH', KEYS[2], ARGV[1 + i])
  redis.call('RPUSH', KEYS[3], ARGV[1 + i])
end
for i = chunks + 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], 'asked:' .. ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[1], 'chunks', chunks)
return 1
"""

_CLAIM = """
local id = redis.call('LPOP', KEYS[1])
if not id then return false end
redis.call('SET', ARGV[1] .. id, ARGV[2], 'PX', ARGV[3])
return id
"""

_REQUEUE_LOST = """
local queued = {}
for _, id in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do queued[id] = true end
local n = 0
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if not queued[id] and redis.call('HEXISTS', KEYS[3], id) == 0 and redis.call('EXISTS', ARGV[1] .. id) == 0 then
    redis.call('RPUSH', KEYS[2], id)
    n = n + 1
  end
end
return n
"""


class EvalChunk(msgspec.Struct, frozen=True):
    """Prompts [start, stop) of a source's evaluation prompts (rollout/evaluation_prompts.py), at `version`."""

    version: int
    source: str
    start: int
    stop: int

    @property
    def id(self) -> str:
        return f"{self.source}|{self.start}|{self.stop}"

    @classmethod
    def parse(cls, version: int, chunk_id: str) -> EvalChunk:
        source, start, stop = chunk_id.rsplit("|", 2)
        return cls(version, source, int(start), int(stop))


class EvalSampleRecord(msgspec.Struct, kw_only=True):
    """One evaluation sample as a node hands it in."""

    row: int  # the prompt's row number in its source
    prompt: str
    completion: str
    reward: float | None
    tokens: int
    finish_reason: str
    versions: list[int]  # the distinct policy versions its tokens were generated at (one: the job's)


class EvalChunkResult(msgspec.Struct, kw_only=True):
    chunk: EvalChunk
    node: str
    samples: list[EvalSampleRecord]


class EvalProgress(msgspec.Struct, kw_only=True):
    version: int
    step: int
    state: str  # open, complete, incomplete
    chunks: int  # -1: not laid out yet (no node live at the version has seen it)
    done: int  # chunks with a result
    asked: dict[str, int]  # prompts asked per source


def chunks_of(version: int, counts: dict[str, int], size: int = CHUNK_PROMPTS) -> list[EvalChunk]:
    """Every source's prompts cut into chunks of `size` (the last one shorter)."""
    return [EvalChunk(version, s, i, min(i + size, n)) for s, n in counts.items() for i in range(0, n, size)]


class EvalJobs:
    """A run's evaluation jobs (module doc); `client` decodes responses (redis_server.connect)."""

    def __init__(self, client: redis.Redis, run: str):
        self.client, self.prefix = client, f"streamrl:{run}:eval:"
        self._lay_out = client.register_script(_LAY_OUT)
        self._claim = client.register_script(_CLAIM)
        self._requeue = client.register_script(_REQUEUE_LOST)

    def _key(self, version: int, part: str = "") -> str:
        return f"{self.prefix}{version}{':' + part if part else ''}"

    def post(self, version: int, step: int) -> None:
        """The learner: an evaluation of `version` (made by `step`) is wanted."""
        with self.client.pipeline() as pipe:
            pipe.hset(self._key(version), mapping={"state": "open", "step": step})
            pipe.sadd(self.prefix + "open", version)
            pipe.execute()

    def open_versions(self) -> set[int]:
        return {int(v) for v in self.client.smembers(self.prefix + "open")}

    def lay_out(self, version: int, counts: dict[str, int]) -> bool:
        """A node: cut an open job into chunks, once; False when it was laid out already (or is not open)."""
        chunks = chunks_of(version, counts)
        asked = [x for source, n in counts.items() for x in (source, n)]
        keys = [self._key(version), self._key(version, "all"), self._key(version, "queue")]
        return bool(self._lay_out(keys=keys, args=[len(chunks), *(c.id for c in chunks), *asked]))

    def claim(self, version: int, node: str, lease_s: float) -> EvalChunk | None:
        """A node: the next chunk of `version`, leased to `node` for `lease_s`; None when none is queued."""
        prefix = self._key(version, "lease:")
        chunk_id = self._claim(keys=[self._key(version, "queue")], args=[prefix, node, int(lease_s * 1000)])
        return EvalChunk.parse(version, chunk_id) if chunk_id else None

    def submit(self, result: EvalChunkResult) -> bool:
        """A node: a chunk's samples (kept only when the chunk has none yet); its lease ends."""
        v, chunk_id = result.chunk.version, result.chunk.id
        with self.client.pipeline() as pipe:
            pipe.hsetnx(self._key(v, "results"), chunk_id, msgspec.json.encode(result).decode())
            pipe.delete(self._key(v, "lease:" + chunk_id))
            kept, _ = pipe.execute()
        return bool(kept)

    def requeue_lost(self, version: int) -> int:
        """Chunks neither queued, nor leased, nor done (their node died holding them) back to the queue."""
        keys = [self._key(version, "all"), self._key(version, "queue"), self._key(version, "results")]
        return int(self._requeue(keys=keys, args=[self._key(version, "lease:")]))

    def progress(self, version: int) -> EvalProgress:
        job = self.client.hgetall(self._key(version))
        asked = {k.removeprefix("asked:"): int(v) for k, v in job.items() if k.startswith("asked:")}
        return EvalProgress(
            version=version,
            step=int(job.get("step", -1)),
            state=job.get("state", "unknown"),
            chunks=int(job.get("chunks", -1)),
            done=int(self.client.hlen(self._key(version, "results"))),
            asked=asked,
        )

    def finished(self, version: int) -> bool:
        """Every chunk of a laid-out job has its result (or the job is closed)."""
        p = self.progress(version)
        return p.state != "open" or (p.chunks >= 0 and p.done >= p.chunks)

    def results(self, version: int) -> list[EvalChunkResult]:
        raw = self.client.hvals(self._key(version, "results"))
        return [msgspec.json.decode(r, type=EvalChunkResult) for r in raw]

    def close(self, version: int, state: str, prompts_done: dict[str, int]) -> None:
        """The learner: the job ends `complete` or `incomplete`; its chunks and samples are dropped (the run
        folder has them), its summary stays for `streamrl status`."""
        with self.client.pipeline() as pipe:
            pipe.hset(self._key(version), mapping={"state": state, **{f"done:{s}": n for s, n in prompts_done.items()}})
            pipe.srem(self.prefix + "open", version)
            pipe.delete(self._key(version, "all"), self._key(version, "queue"), self._key(version, "results"))
            pipe.execute()

    def jobs(self) -> list[dict[str, str]]:
        """Every job's hash with its version, oldest first (`streamrl status`)."""
        found = []
        for key in self.client.scan_iter(match=self.prefix + "*", count=1000):
            tail = key.removeprefix(self.prefix)
            if tail.isdigit():
                found.append({"version": tail, **self.client.hgetall(key)})
        return sorted(found, key=lambda j: int(j["version"]))
