"""A clean stop of the learner (Ctrl-C, SIGTERM) at a point where its state can be saved.

SIGINT and SIGTERM stop the learner as a KeyboardInterrupt, as before, except while a step updates the model and
commits its version (`hold` .. `release`): a signal then waits for the commit, so the model, the optimizer and the
ledger agree on the last step done (`done_step`), which the learner checkpoints as it stops (Keeper.save_on_stop).
A second signal while that save runs cuts it short: the last complete checkpoint stays the one to resume from
(a save is written whole or not at all). Under `streamrl run` the launcher bounds the save by its grace (SIGKILL
after `stop_grace_s`).
"""

from __future__ import annotations

import signal


class CleanStop:
    """Signals as KeyboardInterrupt, held back while the model is updated (module doc)."""

    def __init__(self, done_step: int = 0):
        self.done_step = done_step  # the last step whose update and commit completed
        self.holding = False
        self.pending: int | None = None  # a signal that came while holding

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.holding:
            self.pending = signum
            return
        raise KeyboardInterrupt(f"signal {signum}")

    def hold(self) -> None:
        """A step's update and commit begin: a signal waits for `release`."""
        self.holding = True

    def release(self, step: int) -> None:
        """Step `step` is updated and committed; a signal that came meanwhile stops the learner now."""
        self.holding, self.done_step = False, step
        if self.pending is not None:
            raise KeyboardInterrupt(f"signal {self.pending}")
