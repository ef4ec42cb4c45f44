"""Which of the received samples a step trains, and with which rewards: the recipes' sample rules.

For each step (`select`), in order:
1. **Soft overlong penalty** (DAPO, `loss.overlong_buffer`): a completion longer than L - buffer tokens loses
   penalty x (length - (L - buffer)) / buffer of reward (L: `presets.completion_limit`); the shaped reward
   is what the advantages and the zero-variance test see. verl adds it in its reward manager the same way.
2. **Dynamic sampling** (`loss.dynamic_sampling`): a group with zero variance (every shaped reward equal, or
   their population std at most `loss.zero_variance_std`) has all-zero advantages; it is dropped in the
   ledger as `zero_variance` and newly admitted groups are taken in its place, so the step keeps
   `learner.groups_per_step` groups. Bounded: at most `loss.refill_limit` x groups_per_step replacement
   groups per step; a step that cannot fill within them trains what it has, and says so. Unlike verl's
   DAPO recipe (`filter_groups.metric=acc`), the test is on the reward the advantages use, so a group whose
   members differ only by the overlong penalty is kept: its advantages are not zero.
3. **Advantages** over each kept group, every member included (for per-token estimators, GAE and REINFORCE++,
   each sample's score instead, which the trainer turns into advantages: learner/critic/token_advantages.py).
4. **Truncated completions masked** (`loss.mask_truncated`): a completion cut by a length limit stays in its
   group's baseline, then leaves the batch (`Selection.masked`; the orchestrator drops them as `truncated`
   when it commits the step, with the rest of their groups, so no credit returns before the step is done).
   Leaving the batch is the same loss as a zero loss mask (no loss token, not in the normaliser, no KL or
   entropy term, as TRL masks it) without its forward.

The ledger's accounting needs nothing new. A dropped group's samples are resolved, so its credit returns
and a node may admit a group in its place: the admission bound (at most what the remaining steps train,
`steps_left` x groups_per_step groups in flight) counts groups in flight, and the dropped ones have left.
Groups are taken in admission order (`Intake.collect`, skipping the groups this step already holds), so a
replacement is the oldest group admitted after the step's own: it was admitted to train a step later, and
trains now, never staler than the ledger allowed. In sync mode the freed credits are taken with the
learner's current weights (the version has not moved), so replacements are on-policy as the mode promises.
One cost: when a step stops refilling (it has its groups, or reached the bound), groups that nodes admitted
for the credits of its last drops wait for the next step; after the run's last step they are surplus (at
most a step's groups), resolved as `preempted` when the run ends.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from streamrl.engine.config import LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner.critic.token_advantages import sequence_scores

log = logging.getLogger("streamrl.learner")

FLAT_EPS = 1e-6  # as learner/advantages.py: rewards this close are equal
TRUNCATED = frozenset({"length", "max_total_tokens", "max_model_len"})  # cut by a limit, not ended

Group = list[Trajectory]
Take = Callable[[int, set[str]], list[Group]]  # (groups wanted, group ids held already) -> whole groups
Drop = Callable[[list[str], str], object]  # (sample ids, reason): resolve them in the ledger


def overlong_penalty(length: int, limit: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to limit - buffer tokens, then falling linearly to -factor at
    the limit (0 when buffer is 0)."""
    if buffer <= 0:
        return 0.0
    return min(0.0, -(length - (limit - buffer)) / buffer * factor)


def is_truncated(trajectory: Trajectory) -> bool:
    """Cut by a length limit (max_tokens, an episode's max_total_tokens, the context) rather than ended by
    the model or the environment. An episode that ran out of turns (`max_turns`) ended its last turn: not cut."""
    return trajectory.finish_reason in TRUNCATED


def zero_variance(rewards: list[float], max_std: float = 0.0) -> bool:
    """No signal in the group: fewer than two rewards, all equal (max_std 0), or population std <= max_std."""
    if len(rewards) < 2 or max(rewards) - min(rewards) <= FLAT_EPS:
        return True
    mean = sum(rewards) / len(rewards)
    return max_std > 0 and math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) <= max_std


@dataclass
class Selection:
    """One step's samples: the groups kept (every member), what is packed, and the figures."""

    groups: list[Group] = field(default_factory=list)  # kept groups, truncated members included
    rewards: list[list[float]] = field(default_factory=list)  # their shaped rewards
    train: list[Trajectory] = field(default_factory=list)  # packed: kept groups less masked members
    advantages: list[float] = field(default_factory=list)  # one per `train` sample
    masked: list[str] = field(default_factory=list)  # truncated completions kept out of the loss (sample ids)
    examined: int = 0  # groups looked at for this step (kept, dropped, replaced)
    zero_variance: int = 0  # of those, with zero variance (dropped when dynamic sampling is on)
    refilled: int = 0  # replacement groups taken
    unfilled: bool = False  # the refill bound was reached before the step had its groups

    def metrics(self, wanted: int) -> dict[str, float]:
        penalties = [p for row in self.rewards for p in row]
        raw = [t.reward for g in self.groups for t in g]
        return {
            "filter/zero_variance_groups": float(self.zero_variance),
            "filter/zero_variance_rate": self.zero_variance / self.examined if self.examined else 0.0,
            "filter/refilled_groups": float(self.refilled),
            "filter/groups": float(len(self.groups)),
            "filter/unfilled": float(self.unfilled or len(self.groups) < wanted),
            "filter/truncated_masked": float(len(self.masked)),
            "reward/overlong_penalty_mean": (sum(penalties) - sum(raw)) / len(raw) if raw else 0.0,
        }

    def episode_figures(self) -> dict[str, float]:
        """Multi-turn episodes of the step's groups (none when every sample is single-turn): turns per
        episode, tool calls made / failed / timed out, and the environment's reward (in an `[env]` run it is
        the reward: reward.functions are not called there)."""
        episodes = [t for g in self.groups for t in g if t.turns]
        if not episodes:
            return {}
        n = len(episodes)
        return {
            "env/episodes": float(n),
            "env/turns_mean": sum(t.turns for t in episodes) / n,
            "env/reward_mean": sum(t.reward for t in episodes if t.reward is not None) / n,
            "env/tool_calls": float(sum(t.tool_calls for t in episodes)),
            "env/tool_failed": float(sum(t.tool_failed for t in episodes)),
            "env/tool_timeouts": float(sum(t.tool_timeouts for t in episodes)),
            "env/tool_calls_per_episode": sum(t.tool_calls for t in episodes) / n,
        }

    def batch_figures(self, version: int, seconds: float) -> dict[str, float]:
        """Tokens, throughput and staleness of the samples trained, against the `version` that trained them."""
        tokens = sum(t.model_tokens for t in self.train)
        lags = [version - t.min_version for t in self.train]
        return {
            "samples": len(self.train),
            "completion_tokens": tokens,
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "staleness_mean": sum(lags) / max(len(lags), 1),  # 0 for a step dynamic sampling left empty
            "staleness_max": max(lags, default=0),
        }


def select(
    take: Take, drop: Drop, n_groups: int, cfg: LossConfig, limit: int, short: Callable[[], int] = lambda: 0
) -> Selection:
    """The step's samples (see the module doc): `take` whole groups in admission order, `drop` resolves
    samples in the ledger; `limit` is the completion length limit of the overlong penalty; `short()`: groups
    the step goes without (given up with their node: learner/places.py), neither waited for nor refilled."""
    out, holding = Selection(), set()
    budget = cfg.refill_limit * n_groups if cfg.dynamic_sampling else 0
    want = n_groups
    while want > 0:
        for group in take(want, holding):
            rewards = [t.reward + overlong_penalty(len(t.completion_ids), limit, cfg.overlong_buffer,
                                                   cfg.overlong_penalty) for t in group]  # fmt: skip
            out.examined += 1
            flat = zero_variance(rewards, cfg.zero_variance_std)
            out.zero_variance += flat
            if flat and cfg.dynamic_sampling:
                drop([t.sample_id for t in group], "zero_variance")  # its credit returns: a node may refill
                continue
            out.groups.append(group)
            out.rewards.append(rewards)
            holding.add(group[0].group_id)
        missing = n_groups - short() - len(out.groups)
        want = min(missing, budget - out.refilled)
        out.refilled += max(want, 0)
        out.unfilled = missing > 0
    _mask_and_advantages(out, cfg)
    return out


def _mask_and_advantages(out: Selection, cfg: LossConfig) -> None:
    advantages = sequence_scores(out.rewards, cfg.advantage)  # per-token estimators: the reward (learner/critic/)
    for group, row in zip(out.groups, advantages):
        for trajectory, advantage in zip(group, row):
            if cfg.mask_truncated and is_truncated(trajectory):
                out.masked.append(trajectory.sample_id)
            else:
                out.train.append(trajectory)
                out.advantages.append(advantage)


def warn_unfilled(step: int, selection: Selection, n_groups: int, cfg: LossConfig) -> None:
    """Say so when a step trains fewer groups than it wanted (the refill bound was reached)."""
    if len(selection.groups) >= n_groups:
        return
    log.warning(
        "step %d: %d of %d groups examined had zero reward variance and were dropped; the refill bound "
        "(loss.refill_limit = %d, %d replacement groups) was reached, so the step trains %d groups instead of %d. "
        "A task this easy or hard for the model wastes generation: check the reward, or raise rollout.group_size",
        step,
        selection.zero_variance,
        selection.examined,
        cfg.refill_limit,
        cfg.refill_limit * n_groups,
        len(selection.groups),
        n_groups,
    )
