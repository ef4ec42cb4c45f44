"""Evaluation of a run with an [env]: each held-out prompt's `eval.n` samples are episodes of the run's
environment, run by the episode runner training uses (rollout/envs/episode.py), every model turn generated
with the evaluation's sampling (engine/config/eval.sampling; its max_tokens caps a turn unless
env.turn_max_tokens is set). As in training, the environment's reward (the sum of its step rewards) is the
sample's reward: reward.functions and eval.rewards are not called. A failed episode (env_error,
env_timeout, ...) is a sample without a reward: it fails pass@k and is counted in reward_errors.

A sample's text is the episode's whole transcript after the prompt (the model's turns and the environment's
answers), its `tokens` the model's own, its versions those of every token (the environment's carry the
version of the model token before them), so the exact-version check reads them as it reads a completion's.
"""

from __future__ import annotations

import asyncio

import msgspec

from streamrl.engine.config import Config
from streamrl.engine.config.eval import sampling
from streamrl.engine.ledger.eval_jobs import EvalSampleRecord
from streamrl.rollout.envs.episode import Episode, EpisodeRunner
from streamrl.rollout.sources import Prompt, prompt_text


class SampledEngine:
    """The engine as an evaluation's episodes see it: every turn generated with the evaluation's sampling."""

    def __init__(self, engine, settings):
        self.engine, self.settings = engine, settings

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int):
        return await self.engine.generate(prompt_ids, n, max_tokens, sampling=self.settings)


def episode_runner(cfg: Config, engine, tokenizer) -> EpisodeRunner:
    """An episode runner of the run's environment (its own tool pool) that samples as the evaluation does."""
    from streamrl.rollout.envs.episode import build_runner

    settings = sampling(cfg.eval, cfg.rollout)
    return build_runner(msgspec.structs.replace(cfg, rollout=settings), SampledEngine(engine, settings), tokenizer)


async def run_episodes(runner: EpisodeRunner, tokenizer, prompts: list[Prompt], data, n: int) -> list[EvalSampleRecord]:
    """Each prompt's `n` episodes, run together (one group a prompt, as training runs a row's group);
    `data`: the source's columns (the prompt text written beside each sample)."""
    groups = await asyncio.gather(*(runner.run_group(p.prompt_ids, p.row, n) for p in prompts))
    return [_record(p, e, prompt_text(p, data), tokenizer) for p, group in zip(prompts, groups, strict=True)
            for e in group]  # fmt: skip


def _record(prompt: Prompt, ep: Episode, asked: str, tokenizer) -> EvalSampleRecord:
    return EvalSampleRecord(
        row=prompt.row_number,
        prompt=asked,
        completion=tokenizer.decode(ep.completion_ids, skip_special_tokens=True),
        reward=None if ep.failure else ep.reward,
        tokens=ep.model_tokens,
        finish_reason=ep.failure or ep.finish_reason,
        versions=sorted(set(ep.versions)),
    )
