"""A tiny model made for a reasoning-gym task: `streamrl make-tiny-model PATH --for reasoning_gym:TASK`.

Why: reasoning-gym scores only the answer inside `<answer>...</answer>`, and a random model never writes
those tags, so every reward is 0 and nothing is learned (issue 38). A real model arrives knowing a format;
this one is taught it in seconds: its tokenizer learns the task's words (its prompts become ~180 tokens,
not ~480) and holds `<answer>` and `</answer>` as single tokens, then a short supervised pass over the
task's own prompts teaches it to reply `<answer>X</answer>` with X drawn at random from the task's answers
and a few distractor words. It knows the format and what answers look like, never which answer is right:
that is left to RL (reward at start ≈ the chance of a random pick).
"""

from __future__ import annotations

import collections
import os
import pathlib
import random

TAGS = ("<answer>", "</answer>")
DISTRACTORS = ("one", "two", "red", "blue", "cat", "dog", "sun", "moon")
MAX_ANSWERS = 30  # the task's most common answers taught at most
BATCH = 16
LR = 3e-3
# `--shape NAME:152k`: Qwen2's own embedding rows (151936) over the 512-token tokenizer, for the LM head's cost at a
# users' size (examples/gpu-1.5b.toml); ids past the tokenizer decode to nothing, as Qwen2's padded ones do
MODEL_VOCAB = {"": 0, "152k": 151936}


def make(path, seed: int, shape: str, dtype: str, device: str, source: str = "", steps: int = 150) -> str:
    """`streamrl make-tiny-model`: the model of `shape` (engine/models.py SHAPES), or with `source` the one made
    for it; the line saying what was written. ValueError for a shape or source it cannot make."""
    from streamrl.engine.models import SHAPES, make_tiny_model

    body, _, vocab = shape.partition(":")
    if body not in SHAPES or vocab not in MODEL_VOCAB:
        raise ValueError(f"--shape {shape!r}: choose one of {', '.join(SHAPES)}, each alone or with ':152k'")
    if source:
        folder, said = make_for(path, source, seed, steps)
        return f"tiny model written to {folder}: {said}"
    sized = {"model_vocab_size": MODEL_VOCAB[vocab]} if MODEL_VOCAB[vocab] else {}
    folder = make_tiny_model(path, seed=seed, dtype=dtype, device=device, **SHAPES[body], **sized)
    return f"tiny model written to {folder}"


def make_for(path: str | os.PathLike, source: str, seed: int = 0, steps: int = 150) -> tuple[pathlib.Path, str]:
    """Write the tiny model made for `source` (reasoning_gym:NAME[:SIZE[:SEED]]) to `path`; (its folder, one
    line saying what it was taught). Raises ValueError naming a source it cannot be made for."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.engine.models import make_tiny_model
    from streamrl.rollout.envs.reasoning_gym import rows as task_rows

    if not source.startswith("reasoning_gym:"):
        raise ValueError(f"--for {source}: give a reasoning-gym task, reasoning_gym:NAME[:SIZE[:SEED]]")
    rows = task_rows(source)
    common = [a for a, _ in collections.Counter(r["answer"] for r in rows).most_common(MAX_ANSWERS)]
    answers = sorted(set(common) | set(DISTRACTORS))
    text = [m["content"] for r in rows[:500] for m in r["messages"]] + [reply(a) for a in answers]
    folder = make_tiny_model(path, seed=seed, text=text, tokens=TAGS)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    rng = random.Random(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        loss = teach(model, tokenizer, [r["messages"] for r in rows], answers, rng, steps)
    model.save_pretrained(folder)
    return folder, (
        f"taught to reply {reply('X')} to {source}'s prompts, X drawn at random from {len(answers)} answers "
        f"({len(common)} of the task's, {len(answers) - len(common)} distractors): {steps} steps, final loss "
        f"{loss:.2f}"
    )


def reply(answer: str) -> str:
    return f"{TAGS[0]}{answer}{TAGS[1]}"


def teach(model, tokenizer, prompts: list[list[dict]], answers: list[str], rng: random.Random, steps: int) -> float:
    """`steps` AdamW steps of next-token loss on the reply alone (prompt tokens masked); the last loss."""
    import torch

    def example() -> tuple[list[int], list[int]]:
        text = tokenizer.apply_chat_template(rng.choice(prompts), tokenize=False, add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        answer = tokenizer.encode(reply(rng.choice(answers)), add_special_tokens=False) + [tokenizer.eos_token_id]
        return prompt + answer, [-100] * len(prompt) + answer

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        batch = [example() for _ in range(BATCH)]
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in batch])  # [B, T]
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])  # [B, T]
        loss = model(input_ids=ids, labels=labels).loss  # right padding: no earlier position sees it
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss)
