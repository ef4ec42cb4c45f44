"""A trainer that sleeps instead of training (`simulate.train_s`), for measuring the scheduler.

Everything around the step is real (the batch, the ledger, the push of the unchanged weights, the
policy version moving once per step); only the forward, backward and optimizer step are a timed sleep
of `train_s` (normal with `train_sd`, clipped at 0).
"""

from __future__ import annotations

import random
import time

from streamrl.engine.config import SimulateConfig
from streamrl.learner.train_step import Trainer


class SimulatedTrainer(Trainer):
    def __init__(self, *args, simulate: SimulateConfig, seed: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.simulate, self.rng = simulate, random.Random(seed)

    def step(self, micro_batches, global_token_count=None) -> dict[str, float]:
        start = time.perf_counter()
        time.sleep(max(0.0, self.rng.gauss(self.simulate.train_s, self.simulate.train_sd)))
        self._advance()
        tokens = float(sum(mb.num_loss_tokens for mb in micro_batches))
        return {"loss": 0.0, "skipped": 0.0, "skipped_steps": 0.0, "skipped_nonfinite": 0.0, "skipped_no_gradient": 0.0,
                "grad_norm": 0.0, "tokens": tokens,
                "positions": float(sum(mb.num_tokens for mb in micro_batches)), "version": float(self.version),
                "step_seconds": time.perf_counter() - start}  # fmt: skip
