"""A generation engine that sleeps instead of generating (`simulate.gen_s`), for measuring the scheduler.

A step's generation takes `gen_s` (normal with `gen_sd`, clipped at 0): each group takes its share,
`gen_s / groups_per_step`, one group at a time, so a node produces a step's groups in about `gen_s`
however many it runs at once. Tokens are `max_tokens` copies of one id, logprob -1 each; weights are
received for real (`weights.Stager`) and swapped in at once, so versions, staleness and the push
behave as in a real run.
"""

from __future__ import annotations

import asyncio
import random
import time

from streamrl.engine.config import Config
from streamrl.engine.messages import WeightsReady
from streamrl.engine.weights import Stager
from streamrl.rollout.backends.protocol import BackendClock, Completion, LiveVersion

SIM_TOKEN = 7


class SimBackend:
    def __init__(self, cfg: Config, device: str = "cpu"):
        sim = cfg.simulate
        self.mean_s = sim.gen_s / cfg.learner.groups_per_step
        self.sd_s = sim.gen_sd / cfg.learner.groups_per_step
        self.rng = random.Random(cfg.run.seed)
        self.live = LiveVersion()
        self.tokens_generated = 0
        self.clock = BackendClock()
        self.stager = Stager(device)
        self._lock: asyncio.Lock | None = None

    @property
    def policy_version(self) -> int:
        return self.live.version

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int) -> list[Completion]:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:  # one group at a time: a step's groups take gen_s together
            version = self.policy_version
            self.clock.begin()
            try:
                await asyncio.sleep(max(0.0, self.rng.gauss(self.mean_s, self.sd_s)))
            finally:
                self.clock.end()
        self.tokens_generated += n * max_tokens
        return [
            Completion(
                token_ids=[SIM_TOKEN] * max_tokens,
                logprobs=[-1.0] * max_tokens,
                finish_reason="length",
                token_versions=[version] * max_tokens,
            )
            for _ in range(n)
        ]

    async def update_weights(self, ready: WeightsReady) -> float:
        start = time.perf_counter()
        staged = await asyncio.to_thread(self.stager.receive, ready)
        self.live.went_live(staged.version)
        self.stager.release()
        return time.perf_counter() - start

    async def warm_up(self) -> float:
        return 0.0

    async def close(self) -> None:
        return None
