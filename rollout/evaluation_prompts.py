"""An evaluation source's prompts, judged as training rows are (rollout/sources.py), and what preflight
checks of [eval] before anything starts.

The prompts of a source are its first `eval.max_prompts` usable rows in file order (every usable row when 0),
each keeping its row number, so two evaluations of the source (two versions, a run and `streamrl eval`)
score the same prompts. `demo:heldout` is the built-in demo task's held-out set: prompts of 9 to 10 of the
demo's words, a length no training row of the demo has (those are 3 to 8 words), so none is trained on.
"""

from __future__ import annotations

import random

import msgspec

from streamrl.engine.config import Config
from streamrl.engine.config.eval import DEMO_HELDOUT, EvalSource, reward_config, source_data
from streamrl.rollout.sources import OVERLONG, Prompt, PromptSourceError, judge, prompt_text, read_rows

HELDOUT_ROWS = 32
HELDOUT_WORDS = (9, 10)  # training demo rows have 3 to 8 words (rewards/demo.py)


def heldout_rows(n: int = HELDOUT_ROWS, seed: int = 0) -> list[dict]:
    """The demo task's held-out rows: `{"prompt": <9-10 demo words>, "answer": "a"}`, seeded."""
    from streamrl.rewards.demo import DEMO_WORDS

    rng = random.Random(1_000_003 + seed)
    return [
        {"prompt": " ".join(rng.choice(DEMO_WORDS) for _ in range(rng.randint(*HELDOUT_WORDS))), "answer": "a"}
        for _ in range(n)
    ]


def source_rows(source: EvalSource, seed: int = 0) -> list:
    """Every row of the source (PromptSourceError when it cannot be read)."""
    return heldout_rows(seed=seed) if source.path == DEMO_HELDOUT else read_rows(source.path)


def eval_prompts(source: EvalSource, cfg: Config, tokenizer) -> list[Prompt]:
    """The prompts an evaluation of `source` asks for; PromptSourceError naming the source when none is usable."""
    data = source_data(source, cfg.data)
    try:
        rows = source_rows(source, cfg.run.seed)
    except PromptSourceError as e:
        raise PromptSourceError(f"eval source {source.name!r}: {e}") from None
    limit = cfg.eval.max_prompts or len(rows)
    prompts, why = [], {}
    for i, row in enumerate(rows):
        if len(prompts) >= limit:
            break
        ids, bad = judge(row, data, tokenizer)
        if ids is None:
            why.setdefault(bad, i)
            continue
        prompts.append(Prompt(prompt_ids=ids, row=row, row_number=i))
    if not prompts:
        reasons = "; ".join(f"row {i}: {'longer than data.max_prompt_tokens' if w == OVERLONG else w}"
                            for w, i in list(why.items())[:3])  # fmt: skip
        raise PromptSourceError(
            f"eval source {source.name!r} ({source.path}) has no usable prompt of {len(rows)} rows"
            + (f" ({reasons})" if reasons else "")
        )
    return prompts


def check(cfg: Config, tokenizer, training_texts: set[str] | None = None) -> list[tuple[str, str]]:
    """What preflight reports of [eval]: (level, message) pairs. Errors: a source that cannot be read or has
    no usable prompt, an evaluation reward that does not resolve or cannot take the source's columns (none is
    called with an [env]: its episodes are the environment's to reward). Warning: a source whose prompts are
    among the training rows' (`training_texts`, the training prompts' text)."""
    from streamrl.rewards.call import column_names
    from streamrl.rewards.registry import REWARD_MODEL, RewardSpecError, check_signature, resolve

    if not cfg.eval.enabled:
        return []
    out: list[tuple[str, str]] = []
    rewards = reward_config(cfg.eval, cfg.reward)
    called = [] if cfg.env.name else rewards.functions  # an [env]'s episodes are rewarded by the environment
    for source in cfg.eval.sources:
        data = source_data(source, cfg.data)
        try:
            prompts = eval_prompts(source, cfg, tokenizer)
        except PromptSourceError as e:
            out.append(("error", str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - a reader's own error (pyarrow, datasets): name it
            why = f"{type(e).__name__}: {e}"
            out.append(("error", f"eval source {source.name!r} ({source.path}) cannot be read: {why}"))
            continue
        columns = column_names(sorted(prompts[0].row), data.answer_column)
        for spec in called:
            try:
                if spec != REWARD_MODEL:
                    check_signature(resolve(spec, rewards), spec, columns)
            except RewardSpecError as e:
                out.append(("error", f"eval source {source.name!r}: {e}"))
        texts = {prompt_text(p, data) for p in prompts}
        shared = texts & (training_texts or set())
        if shared:
            said = f"{len(shared)} of its {len(texts)} prompts are training prompts too (e.g. {min(shared)[:60]!r})"
            out.append(("warning", f"eval source {source.name!r}: {said}: its scores are not held-out"))
        else:
            each = "episodes" if cfg.env.name else "samples"
            out.append(("info", f"eval source {source.name!r}: {len(prompts)} prompts x {cfg.eval.n} {each}"))
    return out


def training_texts(cfg: Config, tokenizer, limit: int) -> set[str]:
    """The text of the training source's first `limit` prompts (the overlap check's other side)."""
    from streamrl.rollout.sources import PromptSource

    data = msgspec.structs.replace(cfg.data, loop=False, shuffle=False)
    texts = set()
    try:
        for prompt in PromptSource(data, tokenizer, seed=cfg.run.seed):
            texts.add(prompt_text(prompt, data))
            if len(texts) >= limit:
                break
    except PromptSourceError:
        pass  # the training source's own check reports it
    return texts


DEMO_EVAL = [f"eval.sources=[{{name='demo-heldout', path='{DEMO_HELDOUT}'}}]", "eval.pass_threshold=0.5"]


def demo_implied(data: dict, cfg: Config) -> tuple[list[str], str]:
    """The built-in demo task (no data.path, the demo reward) with no [eval] given: its held-out prompts
    evaluated before and after training, a sample passing at a share of 'a' of at least 0.5 (the overrides,
    one line saying so); ([], '') otherwise."""
    if cfg.data.path or cfg.env.name or list(cfg.reward.functions) != ["demo"] or "eval" in data:
        return [], ""
    return DEMO_EVAL, "the demo evaluates its held-out prompts before and after training (set [eval] to change it)"
