"""A trial call of each reward before any process of a run starts (ops/preflight.py): a reward that raises, breaks
the contract (rewards/call.py) or passes its deadline stops the command in seconds, not after the learner and the
nodes started (issue 53: a reward raising on every call was found after 26.9 s, its run folder left behind).

    problems = trial(cfg.reward, trial_batch(cfg.data, tokenizer, cfg.run.seed))   # (level, message) pairs

Each reward is called once on a few rows of the data: the first prompts, each with short dummy completions,
in one reward worker with the run's own deadline (reward.timeout_s), so a slow reward cannot stall the check.

A reward whose trial is not meaningful (a remote judge that costs money a call, one that needs a server the run
starts) opts out by a marker on the function, no streamrl import needed: `judge.streamrl_trial = False` (or the
`@no_trial` decorator). `reward_model` is never tried: it is a model on the node's device, checked as a folder.
"""

from __future__ import annotations

import itertools
from typing import Any

from streamrl.engine.config import DataConfig, RewardConfig

from .call import Batch, CallOutcome, rows_to_columns
from .registry import REWARD_MODEL, resolve

MARKER = "streamrl_trial"  # `fn.streamrl_trial = False`: no trial call for this reward
PROMPTS = 2  # the first usable prompts of the data
DUMMIES = ("I do not know.", "The answer is 4.")  # a completion with no answer and one with a guess
OPT_OUT = f"a reward whose trial is not meaningful opts out with `fn.{MARKER} = False`"


def no_trial(fn):
    """Mark `fn` as a reward preflight does not call (module doc); returns `fn`."""
    setattr(fn, MARKER, False)
    return fn


def trial_batch(data: DataConfig, tokenizer, seed: int = 0) -> Batch:
    """The first PROMPTS usable prompts of `data`, each with one completion per DUMMIES entry; the row's answer
    column, where it has one, is the first completion instead (a reward that parses answers sees one)."""
    from streamrl.rollout.sources import PromptSource, prompt_text

    prompts, completions, rows = [], [], []
    for prompt in itertools.islice(PromptSource(data, tokenizer, seed), PROMPTS):
        answer = prompt.row.get(data.answer_column)
        texts = [str(answer), *DUMMIES[1:]] if isinstance(answer, (str, int, float)) else list(DUMMIES)
        prompts += [prompt_text(prompt, data)] * len(texts)
        completions += texts
        rows += [prompt.row] * len(texts)
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in completions]
    columns = rows_to_columns(rows, len(rows), data.answer_column)
    return Batch(prompts=prompts, completions=completions, completion_ids=ids, columns=columns)


def tried(cfg: RewardConfig) -> list[str]:
    """The specs of `cfg.functions` a trial calls: not `reward_model`, not one marked `streamrl_trial = False`."""
    return [s for s in cfg.functions if s != REWARD_MODEL and getattr(resolve(s, cfg), MARKER, True) is not False]


def trial(cfg: RewardConfig, batch: Batch, source: str = "the data") -> list[tuple[str, str]]:
    """Call each tried reward once on `batch` in one pool worker; (level, message) for each that failed ('error')
    or raised on the batch but not on each sample alone ('warning'). `source` names where the prompts came from."""
    import msgspec

    from .pool import RewardPool, RewardPoolError

    specs = tried(cfg)
    if not specs or not len(batch):
        return []
    pool_cfg = msgspec.structs.replace(cfg, workers=1)  # one worker, the run's deadline and start method
    try:
        pool = RewardPool(specs, pool_cfg)
    except RewardPoolError as e:
        return [("error", str(e))]
    try:
        outcomes = pool.run(list(range(len(specs))), batch)
    except RewardPoolError as e:
        return [("error", str(e))]
    finally:
        pool.close()
    what = f"a trial call on {len(batch)} samples (the first prompts of {source}, dummy completions)"
    return [found for spec, outcome in zip(specs, outcomes) if (found := judge(spec, outcome, what, cfg))]


def judge(spec: str, outcome: CallOutcome, what: str, cfg: RewardConfig) -> Any:
    """(level, message) for a trial outcome that stops the run or warns; None for one that passed."""
    if outcome.timeouts:
        return "error", (
            f"reward {spec!r} did not return within reward.timeout_s = {cfg.timeout_s:g} s on {what}; make it "
            f"faster or raise reward.timeout_s; {OPT_OUT}"
        )
    said = outcome.traceback.strip().splitlines()[-1] if outcome.traceback.strip() else ""
    if outcome.errors:
        alone = "; each sample alone: " + ("all failed" if outcome.errors == len(outcome.values) else "some failed")
        return "error", f"reward {spec!r} failed {what}: {said}{alone * outcome.fell_back}; {OPT_OUT}"
    if outcome.fell_back:
        return "warning", (
            f"reward {spec!r} raised on {what} ({said}) but not on each sample alone: the run will score every "
            "batch one sample a call (slower)"
        )
    return None
