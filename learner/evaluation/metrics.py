"""What an evaluation of one source at one version measures, from its scored samples (pure functions).

pass@k is the unbiased estimator of Chen et al. 2021 (Codex, eq. 1): of a prompt's n samples, c pass (reward
>= eval.pass_threshold); the chance that k drawn without replacement include a passing one is
1 - C(n-c, k) / C(n, k), averaged over prompts. Computed exactly from integers (Python's int division is
correctly rounded), where the paper's numpy form takes the product prod_{i=n-c+1}^{n} (1 - k/i) to stay in
floats. mean@n and best@n are verl's names: per prompt the mean and the best of its n rewards, averaged over
prompts. A sample whose reward failed (None) counts as failing pass@k and is counted in `reward_errors`; it
is left out of the reward means.

An evaluation that did not cover every prompt it asked for is `complete = 0` with its coverage, and no mean:
a mean over a silent subset is what this refuses to report.
"""

from __future__ import annotations

import dataclasses
import math
import statistics


@dataclasses.dataclass(frozen=True)
class Scored:
    """One evaluation sample, as the metrics see it."""

    prompt: int  # the prompt's row number in its source
    reward: float | None  # None: a reward function failed on it
    tokens: int  # completion tokens
    truncated: bool  # cut at max_tokens (finish_reason "length")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that k of n samples, c of them passing, drawn without replacement include a passing one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def by_prompt(samples: list[Scored]) -> dict[int, list[Scored]]:
    groups: dict[int, list[Scored]] = {}
    for s in samples:
        groups.setdefault(s.prompt, []).append(s)
    return groups


def summarize(samples: list[Scored], n: int, asked: int, threshold: float) -> dict[str, float]:
    """The evaluation's metrics (unprefixed names): coverage always, the means only when every one of the
    `asked` prompts has its `n` samples."""
    groups = by_prompt(samples)
    done = sum(len(g) >= n for g in groups.values())
    out = {"prompts_done": float(done), "prompts_asked": float(asked), "samples": float(len(samples))}
    out["complete"] = float(done == asked and asked > 0)
    if not out["complete"]:
        return out
    rewards = [s.reward for s in samples if s.reward is not None]
    out["reward_errors"] = float(len(samples) - len(rewards))
    out["reward_mean"] = statistics.fmean(rewards) if rewards else math.nan
    for k in range(1, n + 1):
        out[f"pass@{k}"] = statistics.fmean(
            pass_at_k(len(g), sum(_passes(s, threshold) for s in g), k) for g in groups.values()
        )
    out[f"mean@{n}"] = statistics.fmean(_mean(g) for g in groups.values())
    out[f"best@{n}"] = statistics.fmean(max((s.reward for s in g if s.reward is not None), default=math.nan)
                                        for g in groups.values())  # fmt: skip
    out["completion_tokens"] = statistics.fmean(s.tokens for s in samples)
    out["truncated_share"] = statistics.fmean(float(s.truncated) for s in samples)
    return out


def _passes(sample: Scored, threshold: float) -> bool:
    return sample.reward is not None and sample.reward >= threshold


def _mean(group: list[Scored]) -> float:
    rewards = [s.reward for s in group if s.reward is not None]
    return statistics.fmean(rewards) if rewards else math.nan
