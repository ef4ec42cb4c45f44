"""A step's per-token advantages (and the critic's targets) from its packed micro-batches.

Estimators that are not per group (`loss.advantage` gae, reinforce_pp, reinforce_pp_baseline) are computed on
each rank at training time, on the micro-batches it trains: the orchestrator packs each sample's *score* on its
loss positions, where a group estimator packs its advantage (`sequence_scores`: the shaped reward; for the
baseline variant the reward less its group's mean), and `token_advantages` turns the scores into advantages:

- gae: rewards at the last loss token, values from the critic -> GAE(gamma, lam_actor) advantages, whitened
  over the whole step (critic.whiten_advantages), and GAE(gamma, lam_critic) returns, the critic's targets;
- reinforce_pp / reinforce_pp_baseline (verl's names; OpenRLHF reinforce / reinforce_baseline): discounted
  returns of those rewards, whitened over the step (no critic).

Whitening needs the mean and variance of every rank's tokens: `token_advantages` takes them from its caller's
`reduce` (the sums of `gae.moments`, reduced over ranks once), so it stays free of ranks. A micro-batch never
splits a sequence (batching.py), so each micro-batch's rows are whole completions; all of a rank's
micro-batches run through one backward recursion, over the longest completion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from streamrl.engine.config.critic import CriticConfig
from streamrl.learner.advantages import group_advantages
from streamrl.learner.batching import MicroBatch
from streamrl.learner.critic import gae as G

PER_TOKEN = ("gae", "reinforce_pp", "reinforce_pp_baseline")


def sequence_scores(rewards: Sequence[Sequence[float]], kind: str) -> list[list[float]]:
    """What each sample carries to the trainer, per group: its advantage (group estimators), its reward
    (gae, reinforce_pp) or its reward less the group's mean (reinforce_pp_baseline)."""
    if kind in ("gae", "reinforce_pp"):
        return [list(map(float, group)) for group in rewards]
    return group_advantages(rewards, "group_mean" if kind == "reinforce_pp_baseline" else kind)[0]


def _layout(mb: MicroBatch) -> tuple[Tensor, int, int]:
    """(loss columns [T], sequences, longest completion in loss tokens)."""
    columns = G.loss_columns(mb.loss_mask, mb.seq_ids, mb.cu_seqlens)
    return columns, mb.cu_seqlens.numel() - 1, int(columns.max()) + 1 if columns.numel() else 0


def _stack(parts: list[Tensor], width: int) -> Tensor:
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def token_advantages(
    micro_batches: list[MicroBatch],
    values: list[Tensor] | None,
    kind: str,
    cfg: CriticConfig,
    reduce: Callable[[Tensor], Tensor],
    kl: list[Tensor] | None = None,
    kl_coef: float = 0.0,
) -> tuple[list[MicroBatch], list[Tensor]]:
    """The micro-batches with per-token advantages in place of their scores, and each one's returns ([T];
    the critic's targets with `values`, else the discounted returns). `reduce` sums `gae.moments` over ranks;
    `kl`: each micro-batch's per-token KL to the reference, kl_coef x it taken from the rewards (the KL
    controller's beta: critic.kl_in_reward, or where the adaptive controller has moved it)."""
    layouts = [_layout(mb) for mb in micro_batches]
    width = max([w for _, _, w in layouts] + [1])
    rows = [(c, s, w) for c, s, w in layouts]

    def stacked(per_mb: list[Tensor]) -> Tensor:
        return _stack(
            [G.to_rows(x, c, mb.seq_ids, s, max(w, 1)) for x, mb, (c, s, w) in zip(per_mb, micro_batches, rows)], width
        )

    mask = stacked([mb.loss_mask.to(torch.float32) for mb in micro_batches]) > 0
    scores = (stacked([mb.advantages for mb in micro_batches]) * G.last_token(mask)).sum(-1)
    rewards = G.token_rewards(scores, mask, stacked(kl) if kl else None, kl_coef)
    if values is None:
        advantages = returns = G.discounted_returns(rewards, mask, cfg.gamma)
        whiten = True
    else:
        v = stacked(values)
        advantages, _ = G.gae(rewards, v, mask, cfg.gamma, cfg.lam_actor)
        _, returns = G.gae(rewards, v, mask, cfg.gamma, cfg.lam_critic)
        whiten = cfg.whiten_advantages
    if whiten:
        advantages = G.whiten(advantages, mask, reduce(G.moments(advantages, mask)))
    out_mbs, out_returns, at = [], [], 0
    for mb, (columns, sequences, _) in zip(micro_batches, rows):
        part = slice(at, at + sequences)
        at += sequences
        out_mbs.append(replace(mb, advantages=G.from_rows(advantages[part], columns, mb.seq_ids)))
        out_returns.append(G.from_rows(returns[part], columns, mb.seq_ids))
    return out_mbs, out_returns
