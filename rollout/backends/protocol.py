"""The seam between the rollout node and whatever generates tokens (vLLM, transformers, a test fake).

Behavior logprobs, for every backend: the log-probability of the sampled token under the distribution
it was drawn from, logits / temperature filtered by top-k then top-p and renormalised over the kept
tokens (engine/sampling.py; vLLM's `processed_logprobs`). The learner computes the same distribution from
its own logits (learner/logprobs.py), so the importance ratio pi / mu compares like with like whatever
the sampling settings (the unfiltered log_softmax(logits / T) would understate mu by the kept mass on
every token, which no importance correction could tell from staleness).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

import msgspec

from streamrl.engine.config import RolloutConfig
from streamrl.engine.messages import WeightsReady


class Completion(msgspec.Struct, kw_only=True):
    """One sampled completion of a prompt, as token ids (never decoded on the way to the learner)."""

    token_ids: list[int]
    logprobs: list[float]  # behavior logprob of each token, under the processed distribution (module doc)
    finish_reason: str  # "stop" (eos or a stop token) or "length" (max_tokens / context)
    token_versions: list[int]  # policy version that sampled each token, one per token

    @property
    def policy_version(self) -> int:
        """Version of the first token (the one the node had when the sample started)."""
        return self.token_versions[0] if self.token_versions else -1


@runtime_checkable
class GenerationBackend(Protocol):
    """What the rollout node needs from a generation backend."""

    policy_version: int
    clock: BackendClock  # where its time goes (reported in heartbeats)

    async def generate(
        self, prompt_ids: list[int], n: int, max_tokens: int, sampling: RolloutConfig | None = None
    ) -> list[Completion]:
        """`n` samples of one prompt (one group), with behavior logprobs and per-token versions; `sampling`:
        temperature, top_k and top_p other than the run's (an evaluation's, engine/config/eval.sampling)."""
        ...

    async def update_weights(self, ready: WeightsReady) -> float:
        """Receive the weights of `ready.version` while generation goes on, swap them in at the next
        safe point, and return once they are live: the seconds from the layout to live."""
        ...

    async def close(self) -> None: ...


class LiveVersion:
    """The policy version whose weights a backend serves: the one place a node sets it.

    Each backend holds one (`live`) and reports it as `policy_version`. `went_live(v)` is called once
    the weights of `v` answer requests, never before: a token stamped with the older version in the
    instant between the swap and the call only overstates its staleness. Versions may go back (a
    learner resumed from an older checkpoint pushes its own).
    """

    def __init__(self) -> None:
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def went_live(self, version: int) -> None:
        self._version = version


class BackendClock:
    """Where a generation engine's time goes: generating, paused for weight swaps, idle (the rest).

    `begin`/`end` bracket work (a request for vLLM, a batch for transformers); overlapping work counts
    once. A swap that pauses running work is counted as swap time, not generation.
    """

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._generate_s = 0.0
        self.swap_s = 0.0
        self._active = 0
        self._busy_since = 0.0
        self._lock = threading.Lock()

    def begin(self) -> None:
        with self._lock:
            if self._active == 0:
                self._busy_since = time.monotonic()
            self._active += 1

    def end(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._generate_s += time.monotonic() - self._busy_since

    def swapped(self, seconds: float) -> None:
        with self._lock:
            self.swap_s += seconds
            if self._active:  # the pause happened inside a busy stretch: not generation
                self._generate_s -= seconds

    def snapshot(self) -> tuple[float, float, float]:
        """(generate_s, idle_s, swap_s) since the engine started."""
        with self._lock:
            now = time.monotonic()
            generate = self._generate_s + (now - self._busy_since if self._active else 0.0)
            return generate, max(0.0, now - self.started - generate - self.swap_s), self.swap_s
