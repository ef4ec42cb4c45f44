"""The [eval] section: held-out prompt sources scored at chosen policy versions, apart from training.

An evaluation of version v samples `n` completions of every prompt of each source (at most `max_prompts`
of them) with the evaluation's own sampling settings, scores them with `functions` (the run's rewards
unless given) and reports, per source and version, the reward mean, pass@k for k = 1..n (a sample passes
when its reward reaches `pass_threshold`), mean@n, best@n, the mean completion length and the truncated
share (docs/EVALUATION.md). `[eval]` is off while `sources` is empty.

    [eval]
    every = 10
    n = 4
    temperature = 0.6
    [[eval.sources]]
    name = "gsm8k-test"
    path = "data/gsm8k_test.jsonl"
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from streamrl.engine.config.base import _doc, _Section
from streamrl.engine.config.rollout import DataConfig, RewardConfig, RolloutConfig

DEMO_HELDOUT = "demo:heldout"  # the built-in demo task's held-out prompts (rows no training seed draws first)


class EvalSource(_Section):
    """One held-out source, named in every metric and file it produces (`eval/<name>/...`)."""

    name: Annotated[
        str, _doc("Name of the source in metrics and in RUN/eval/<name>/.", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    ]
    path: Annotated[
        str,
        _doc(
            "The forms data.path takes (.jsonl, .parquet, a saved HF dataset folder, reasoning_gym:NAME[:SIZE"
            f"[:SEED]], verifiers:ID), or {DEMO_HELDOUT}: the built-in demo task's held-out prompts.",
            min_length=1,
        ),
    ]
    prompt_column: Annotated[str, _doc("Column holding the prompt text; empty: data.prompt_column.")] = ""
    messages_column: Annotated[str, _doc("Column holding chat messages; empty: data.messages_column.")] = ""
    answer_column: Annotated[str, _doc("Column passed to rewards as the answer; empty: data.answer_column.")] = ""


class EvalConfig(_Section):
    sources: Annotated[list[EvalSource], _doc("Held-out sources ([[eval.sources]] tables); none: no evaluation.")] = (
        msgspec.field(default_factory=list)
    )
    every: Annotated[
        int,
        _doc(
            "Evaluate every this many policy versions during training; 0: only before training (if "
            "before_training) and at the last version, which is always evaluated.",
            ge=0,
        ),
    ] = 0
    before_training: Annotated[bool, _doc("Evaluate version 0, the model before any training step.")] = True
    n: Annotated[int, _doc("Completions sampled per prompt (pass@k for k = 1..n).", ge=1, le=1024)] = 1
    temperature: Annotated[
        float, _doc("Sampling temperature of evaluation requests; 0: greedy (the likeliest token).", ge=0.0, le=10.0)
    ] = 0.0
    top_p: Annotated[float, _doc("Nucleus sampling mass of evaluation requests.", gt=0.0, le=1.0)] = 1.0
    max_tokens: Annotated[int, _doc("Most completion tokens per evaluation sample; 0: rollout.max_tokens.", ge=0)] = 0
    max_prompts: Annotated[int, _doc("Prompts evaluated per source (its first rows); 0: every row.", ge=0)] = 0
    functions: Annotated[
        list[str], _doc("Reward functions of the evaluation (as reward.functions); empty: the run's.")
    ] = msgspec.field(default_factory=list)
    pass_threshold: Annotated[
        float, _doc("A sample passes (counts as correct for pass@k) when its reward is at least this.")
    ] = 1.0

    def __post_init__(self) -> None:
        names = [s.name for s in self.sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"eval.sources names {twice} more than once; give each source a name of its own")

    @property
    def enabled(self) -> bool:
        return bool(self.sources)


def due(cfg: EvalConfig, version: int, last_version: int) -> bool:
    """Whether `version` is evaluated: 0 with before_training, every `every`-th version, and the last."""
    if not cfg.enabled:
        return False
    if version == 0:
        return cfg.before_training
    return version == last_version or (cfg.every > 0 and version % cfg.every == 0)


def source_data(source: EvalSource, data: DataConfig) -> DataConfig:
    """How the source's rows are read: data's columns unless the source names its own, in file order, once."""
    return msgspec.structs.replace(
        data,
        path=source.path,
        prompt_column=source.prompt_column or data.prompt_column,
        messages_column=source.messages_column or data.messages_column,
        answer_column=source.answer_column or data.answer_column,
        loop=False,
        shuffle=False,
    )


def reward_config(cfg: EvalConfig, reward: RewardConfig) -> RewardConfig:
    """The run's reward section with the evaluation's functions (its weights dropped: all 1.0) where given."""
    if not cfg.functions:
        return reward
    return msgspec.structs.replace(reward, functions=list(cfg.functions), weights=[])


def sampling(cfg: EvalConfig, rollout: RolloutConfig) -> RolloutConfig:
    """The rollout settings evaluation requests are generated with: n per prompt, its own temperature, top_p
    and max_tokens. Greedy (temperature 0) is top_k = 1 at temperature 1: the likeliest token, the same in
    vLLM and transformers (whose sampler takes no temperature 0)."""
    greedy = cfg.temperature == 0.0
    return msgspec.structs.replace(
        rollout,
        group_size=cfg.n,
        temperature=1.0 if greedy else cfg.temperature,
        top_k=1 if greedy else 0,
        top_p=1.0 if greedy else cfg.top_p,
        max_tokens=cfg.max_tokens or rollout.max_tokens,
    )
