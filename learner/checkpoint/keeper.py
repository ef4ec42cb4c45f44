"""The learner loop's handle on checkpoints: when it saves, exports and resumes."""

from __future__ import annotations

import logging
import os
import pathlib
import time

from torch import nn

from streamrl.engine.config import CheckpointConfig
from streamrl.engine.messages import AdapterSpec
from streamrl.learner import parallel
from streamrl.learner.checkpoint.layout import (
    DiskFullError,
    LearnerState,
    check_writable,
    checkpoints_dir,
    estimate_bytes,
    resolve,
)
from streamrl.learner.checkpoint.store import _on_rank0_then_share, load, local_path, save, write_hf_files
from streamrl.learner.export import export_adapter, export_state

log = logging.getLogger("streamrl.learner")


class Keeper:
    """When the learner saves, exports and resumes (`checkpoint.every`, `export_every`, `--resume`).

    Saves every `checkpoint.every` steps, or by default as often as `checkpoint.budget` allows: the next save
    waits until the time since the last one ended (or since the first step) is at least the last one's
    duration / budget and `min_interval_s`, so saves take at most `budget` of the run's time; and at the last
    step. A save that
    does not fit on the disk is skipped with a warning, the run going on; the last one's failure ends it.
    Built before training: an unwritable folder, or a disk without room for one checkpoint, fails the run
    at start, not at the first save an hour in. `trainer` needs `.optimizer`, `.scheduler`, `.state_dict()`,
    `.load_state_dict()`.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | os.PathLike,
        lm: nn.Module,
        trainer,
        model_source: str,
        last_step: int,
        adapter: AdapterSpec | None = None,
    ):
        """adapter: LoRA's spec; checkpoints then hold the adapters and their optimizer state alone."""
        self.cfg, self.lm, self.trainer, self.model_source = cfg, lm, trainer, local_path(model_source)
        self.adapter = adapter
        self.root, self.exports = checkpoints_dir(run_dir), pathlib.Path(run_dir) / "exports"
        self.last_step = last_step
        self.saves = bool(cfg.every or cfg.budget)
        self.need = estimate_bytes(lm, model_source, parallel.world_size())
        # when the last save ended (the clock starts at the first step: not while the nodes start), what it took
        self.saved_at: float | None = None
        self.save_s = 0.0
        self.saved_step = 0  # the step of the last checkpoint this learner saved (or resumed from)
        if self.saves:
            _on_rank0_then_share(lambda: check_writable(self.root, self.need))
            import torch.distributed.checkpoint  # noqa: F401 - 1-3 s on a loaded CPU: now, not in the first save
        if cfg.export_every:
            _on_rank0_then_share(lambda: check_writable(self.exports, self.need // 3))
            if parallel.is_rank0():
                write_hf_files(lm, model_source, self.exports / ".hf")

    def resume(self, spec: str, run_dir: str | os.PathLike) -> LearnerState:
        """Every rank: load the checkpoint `spec` names (`latest`, or a path) into the model and trainer."""
        path = resolve(spec, run_dir)
        critic = getattr(self.trainer, "shaper", None)  # the critic's model and optimizer (checkpoint/critic.py)
        state = load(path, self.lm, self.trainer.optimizer, self.trainer.scheduler, critic=critic)
        self.trainer.load_state_dict(state.trainer_state())
        self.saved_step = state.step
        if parallel.is_rank0():
            log.info(
                "resumed from %s: step %d, version %d, saved by %d ranks, loaded on %d",
                path,
                state.step,
                state.version,
                state.world_size,
                parallel.world_size(),
            )
        return state

    def after_step(self, step: int, policy: nn.Module) -> None:
        """Every rank: save and export when due (and at the last step). The host copy of the weights an
        export needs is made only then (`parallel.full_state_dict`, every rank takes part)."""
        if self._save_due(step):
            self._save(step)
        due = lambda every: every and (step % every == 0 or step == self.last_step)  # noqa: E731
        if due(self.cfg.export_every) and self.adapter is not None:  # LoRA: a PEFT adapter folder
            from streamrl.learner.lora import adapter_state

            tensors = {k: v.cpu() for k, v in adapter_state(self.lm).items()}
            if parallel.is_rank0():
                out = self.exports / f"step_{step}"
                export_adapter(tensors, self.adapter, self.model_source, self.exports / ".hf", out, overwrite=True)
        elif due(self.cfg.export_every):
            full_state = parallel.full_state_dict(policy)
            if parallel.is_rank0():
                export_state(full_state, self.exports / ".hf", self.exports / f"step_{step}", overwrite=True)

    def save_on_stop(self, step: int) -> bool:
        """A learner stopping cleanly (learner/clean_stop.py) saves step `step`, its last complete one, unless a
        checkpoint of it exists or saving is off; one rank only (a save is collective, and a signal may have
        reached the ranks at different points). Whether it saved."""
        if not self.saves or step <= self.saved_step:
            return False
        if parallel.world_size() > 1:
            log.warning("stopped at step %d: not saved (a clean stop saves with one rank only)", step)
            return False
        try:
            self._save(step)
        except Exception as e:  # the stop goes on; the last complete checkpoint stays
            log.error("stopped at step %d: its checkpoint failed: %s", step, e)
        if self.saved_step == step:
            log.info("stopped at step %d: saved in %.1f s (continue with --resume latest)", step, self.save_s)
        return self.saved_step == step

    def _save_due(self, step: int) -> bool:
        """The same answer on every rank: by steps (`every`), else by rank 0's clock (`budget`)."""
        if not self.saves:
            return False
        if step == self.last_step or self.cfg.every:
            return step == self.last_step or step % self.cfg.every == 0
        if self.saved_at is None:
            self.saved_at = time.monotonic()
        wait_s = max(self.cfg.min_interval_s, self.save_s / self.cfg.budget)
        return parallel.from_rank0(time.monotonic() - self.saved_at >= wait_s)

    def _save(self, step: int) -> None:
        started = time.monotonic()
        state = LearnerState(step=step, **self.trainer.state_dict())
        args = (self.lm, self.trainer.optimizer, self.trainer.scheduler, state, self.model_source)
        try:
            critic = getattr(self.trainer, "shaper", None)
            save(self.root, *args, self.cfg.keep_last, self.cfg.keep_every, self.adapter, need=self.need, critic=critic)
        except DiskFullError as e:
            if step == self.last_step:
                raise
            if parallel.is_rank0():
                log.warning("the checkpoint of step %d was skipped (training goes on): %s", step, e)
        else:
            self.saved_step = step
        self.saved_at = time.monotonic()
        self.save_s = self.saved_at - started
