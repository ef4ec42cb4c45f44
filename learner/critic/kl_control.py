"""The coefficient beta of the KL penalty in the reward (critic.kl_in_reward): fixed, or adaptive.

The adaptive controller is Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences", 2.2),
as verl's `AdaptiveKLController`, OpenRLHF's and TRL's implement it. After each step:

    e    = clip(KL / kl_target - 1, -0.2, 0.2)
    beta = beta x (1 + e x n / kl_horizon)

KL is the step's mean over its completions of each completion's mean over its loss tokens of
log mu - log pi_ref (`sequence_kl`; verl's `current_kl`, OpenRLHF's `kl`), and n the step's completions
(verl's and OpenRLHF's `n_steps`: the batch's samples). TRL sums the KL over a completion's tokens instead, so
its default target (6) is per completion, not per token: a TRL target divided by the completion's length is
the kl_target here. A step's rewards use beta as it was before the step's update, as in verl.

Where it differs: the batch is the step's samples over every rank (the sums are reduced by the caller), and
mu is the sampling policy of each sample, which in an asynchronous run may be a few versions behind the
learner (verl's `old_log_probs` are the learner's own before its update, on-policy).
"""

from __future__ import annotations

import torch
from torch import Tensor

ERROR_CLIP = 0.2  # Ziegler et al.'s clip of the proportional error; verl, OpenRLHF and TRL keep it


class KLController:
    """Owns beta (STYLE 15): the only code that assigns it, and it saves and restores it itself. Fixed: beta
    is critic.kl_in_reward for ever, and a checkpoint keeps nothing (a resumed run takes the config's value)."""

    def __init__(self, init: float, adaptive: bool = False, target: float = 0.1, horizon: int = 10000) -> None:
        self.value, self.adaptive, self.target, self.horizon = float(init), adaptive, float(target), int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """One step's move: `current_kl` the step's mean per-completion KL, `n_steps` its completions."""
        if not self.adaptive:
            return
        error = min(max(current_kl / self.target - 1.0, -ERROR_CLIP), ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float | None]:
        return {"kl_coef": self.value if self.adaptive else None}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("kl_coef")
        if self.adaptive and saved is not None:  # else the config's start (a checkpoint of a fixed run has None)
            self.value = float(saved)


def sequence_kl(kl: Tensor, mask: Tensor, seq_ids: Tensor, sequences: int) -> Tensor:
    """[2] float64: (the sum over sequences of each one's mean KL over its loss tokens, sequences with a loss
    token), of one packed micro-batch ([T] each); summed over micro-batches and ranks, their ratio is
    `KLController.update`'s current_kl and the count its n_steps."""
    m = mask.to(torch.bool)
    sums = torch.zeros(sequences, dtype=torch.float64, device=kl.device)
    sums.index_add_(0, seq_ids, torch.where(m, kl.to(torch.float64), 0.0))
    counts = torch.zeros_like(sums).index_add_(0, seq_ids, m.to(torch.float64))
    has = counts > 0
    return torch.stack([(sums[has] / counts[has]).sum(), has.sum().to(torch.float64)])
