"""What a training group becomes on a rollout node: its completions generated (or its episodes run),
scored, and made into the `Trajectory` messages the learner receives.

Single-turn (`GroupMaker.completions`): one `generate` call for the group's `n` samples, rewards from
the reward functions in one call for the groups that finish together (rollout/scoring.py). Multi-turn
(`GroupMaker.episodes`, `env.name` set): `rollout.group_size` episodes of the row (rollout/envs); a failed
episode is dropped in the ledger with its reason, and the survivors go out as a smaller group.

A sample's versions are decided in one place (`stamp`): its `policy_version` is the version of its first
token, and `token_versions` are sent only when the weights changed mid-sample (the learner's staleness
reads them); a sample without a stamped token takes the engine's live version.
"""

from __future__ import annotations

import time

from streamrl.engine.config import Config
from streamrl.engine.messages import Timings, Trajectory
from streamrl.rollout.backends.protocol import Completion, GenerationBackend
from streamrl.rollout.envs.episode import Episode, EpisodeRunner
from streamrl.rollout.scoring import GroupScorer
from streamrl.rollout.seams import Credits, NodeStats, Scorer
from streamrl.rollout.sources import Prompt


def stamp(token_versions: list[int], live_version: int) -> tuple[int, list[int]]:
    """(policy_version, token_versions) of a sample whose tokens were sampled under `token_versions`: the
    first token's version, and the per-token list only when they are mixed (`live_version` when no token
    carries a version)."""
    if not token_versions:
        return live_version, []
    return token_versions[0], list(token_versions) if len(set(token_versions)) > 1 else []


class GroupMaker:
    """Generates, scores and wraps one training group. `runner`: the episodes' (env mode), else None;
    `credits.drop` resolves a failed episode's sample; `stats` counts the samples sent without a reward."""

    def __init__(
        self,
        cfg: Config,
        node_id: str,
        engine: GenerationBackend,
        scorer: Scorer,
        tokenizer,
        credits: Credits,
        stats: NodeStats,
        runner: EpisodeRunner | None = None,
    ):
        self.cfg, self.node_id, self.engine, self.scorer = cfg, node_id, engine, scorer
        self.credits, self.stats, self.runner = credits, stats, runner
        self._scoring = GroupScorer(scorer, tokenizer, cfg.data)  # groups finishing together: one reward call

    async def make(self, group_id: str, sample_ids: list[str], prompt: Prompt) -> list[Trajectory]:
        """The group's trajectories: its episodes' survivors (env mode) or its completions."""
        if self.runner is not None:
            return await self.episodes(group_id, sample_ids, prompt)
        return await self.completions(group_id, sample_ids, prompt)

    async def completions(self, group_id: str, sample_ids: list[str], prompt: Prompt) -> list[Trajectory]:
        submitted = time.time()
        cap = prompt.cap(self.cfg.rollout.max_tokens)  # the row's own cap (data's max_tokens column), if lower
        completions = await self.engine.generate(prompt.prompt_ids, len(sample_ids), cap)
        finished = time.time()
        rewards = await self._scoring.score(prompt, completions)
        timings = Timings(submitted=submitted, finished=finished, rewarded=time.time())
        self.stats.rewards_none += sum(r is None for r in rewards)
        size = self.cfg.rollout.group_size
        return [
            self._trajectory(sid, group_id, prompt.prompt_ids, c, r, size, timings)
            for sid, c, r in zip(sample_ids, completions, rewards, strict=True)
        ]

    async def episodes(self, group_id: str, sample_ids: list[str], prompt: Prompt) -> list[Trajectory]:
        """The group's episodes; failed ones dropped in the ledger, the rest a group of the survivors."""
        episodes = await self.runner.run_group(prompt.prompt_ids, prompt.row, len(sample_ids))
        for reason in sorted({e.failure for e in episodes if e.failure}):
            await self.credits.drop([s for s, e in zip(sample_ids, episodes) if e.failure == reason], reason)
        survivors = [(s, e) for s, e in zip(sample_ids, episodes) if not e.failure]
        return [self._episode_trajectory(s, group_id, e, len(survivors)) for s, e in survivors]

    def _episode_trajectory(self, sample_id: str, group_id: str, ep: Episode, group_size: int) -> Trajectory:
        """An episode's tokens as one sample (environment tokens masked out of the loss)."""
        sampled = Completion(token_ids=ep.completion_ids, logprobs=ep.logprobs, finish_reason=ep.finish_reason,
                             token_versions=ep.versions)  # fmt: skip
        timings = Timings(submitted=ep.started, finished=ep.generated, rewarded=time.time())
        episode = dict(
            loss_mask=ep.mask if 0 in ep.mask else [],
            turns=ep.turns,
            tool_calls=ep.tools.get("calls", 0),
            tool_failed=ep.tools.get("failed", 0),
            tool_timeouts=ep.tools.get("timed_out", 0),
        )
        return self._trajectory(sample_id, group_id, ep.prompt_ids, sampled, ep.reward, group_size, timings, **episode)

    def _trajectory(
        self,
        sample_id: str,
        group_id: str,
        prompt_ids: list[int],
        sampled: Completion,
        reward: float | None,
        group_size: int,
        timings: Timings,
        **episode,
    ) -> Trajectory:
        """The one place a sample becomes a `Trajectory`: its versions stamped, a missing reward explained."""
        version, token_versions = stamp(sampled.token_versions, self.engine.policy_version)
        return Trajectory(
            sample_id=sample_id,
            group_id=group_id,
            node_id=self.node_id,
            seq=0,
            prompt_ids=prompt_ids,
            completion_ids=sampled.token_ids,
            behavior_logprobs=sampled.logprobs,
            reward=reward,
            reward_error=self._reward_error() if reward is None else "",
            policy_version=version,
            token_versions=token_versions,
            finish_reason=sampled.finish_reason,
            group_size=group_size,
            timings=timings,
            **episode,
        )

    def _reward_error(self) -> str:
        """Why a reward is None: the scorer's first failure (a test's scorer may not keep one)."""
        return getattr(self.scorer, "first_error", "") or "a reward returned None"
