"""The most a critic can explain on the demo: E[reward | prefix] by Monte Carlo under a run's exported policies.

    python -m streamrl.bench.critic_ceiling RUN/exports/step_12 [RUN/exports/step_14 ...] [--values-of PREV ...]
                                            [--prompts 32] [--continuations 16] [--seed 0]

A run made with `--set checkpoint.export_every=1` (e.g. `python -m streamrl.bench.ppo_demo --only ppo --set
checkpoint.export_every=1`) leaves each step's policy under exports/step_N. For each folder: one completion of
`--prompts` demo prompts (temperature 1, up to 24 tokens, as the demo samples), and at every completion token k
the value of the best critic there is, E[reward | prompt + completion[:k]], estimated from `--continuations`
fresh continuations of that prefix. Its explained variance against the completions' rewards, over every loss
token and at each completion's last token, is the ceiling of `critic/vf_explained_var` and `_last` for samples of
that policy. `--values-of` takes the continuations from another policy (one per folder, e.g. the previous step's):
the best a critic that knows only the policy before can do, as the run's critic, scored before its update.

One JSON line per folder (`figure: critic_ceiling`). The estimate's own noise (its sample variance / M) is taken
out of the residual, so the ceiling is not understated by a finite M; `raw_explained_var*` keep it in.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

import torch

from streamrl.engine.models import default_tiny_model
from streamrl.rewards.demo import demo_rows, letter_share

LENGTH = 24  # the demo's rollout.max_tokens


def explained(values: torch.Tensor, noise: torch.Tensor, returns: torch.Tensor) -> tuple[float, float]:
    """(explained variance, raw): 1 - Var(returns - values) / Var(returns), with the mean of `noise` (each value
    estimate's variance) taken out of the residual's variance in the first, as it is the estimate's and not the
    best critic's error."""
    var = returns.var()
    raw = 1.0 - (returns - values).var() / var
    return float(raw + noise.mean() / var), float(raw)


def sample(model, prefixes: list[list[int]], new: int, n: int, eos: int) -> list[list[int]]:
    """`n` continuations of each prefix, up to `new` tokens, each cut after its first EOS."""
    seqs = [p for p in prefixes for _ in range(n)]
    width = max(map(len, seqs))
    ids = torch.tensor([[eos] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        max_new_tokens=new, pad_token_id=eos, eos_token_id=eos,
    )[:, width:].tolist()  # fmt: skip
    return [o[: o.index(eos) + 1] if eos in o else o for o in out]


def ceiling(policy: str, values_of: str, prompts: int, continuations: int, seed: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(default_tiny_model()))
    eos = tokenizer.eos_token_id
    actor = AutoModelForCausalLM.from_pretrained(policy).eval()
    critic = AutoModelForCausalLM.from_pretrained(values_of).eval() if values_of != policy else actor
    rows = random.Random(seed).sample(demo_rows(512, 0), prompts)
    ids = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]

    def reward(completion: list[int]) -> float:
        return letter_share(tokenizer.decode(completion, skip_special_tokens=True), "a")

    values, noise, returns, last = [], [], [], []
    with torch.no_grad():
        completions = sample(actor, ids, LENGTH, 1, eos)
        for k in range(LENGTH):
            live = [i for i, c in enumerate(completions) if k < len(c)]
            if not live:
                break
            more = sample(critic, [ids[i] + completions[i][:k] for i in live], LENGTH - k, continuations, eos)
            for j, i in enumerate(live):
                mine = more[j * continuations : (j + 1) * continuations]
                outcomes = torch.tensor([reward(completions[i][:k] + c) for c in mine])
                values.append(float(outcomes.mean()))
                noise.append(float(outcomes.var()) / continuations)
                returns.append(reward(completions[i]))
                last.append(k == len(completions[i]) - 1)
    values_t, noise_t, returns_t, last_t = map(torch.tensor, (values, noise, returns, last))
    every = explained(values_t, noise_t, returns_t)
    at_last = explained(values_t[last_t], noise_t[last_t], returns_t[last_t])
    rewards = torch.tensor([reward(c) for c in completions])
    return {
        "figure": "critic_ceiling",
        "policy": pathlib.Path(policy).name,
        "values_of": pathlib.Path(values_of).name,
        "prompts": prompts,
        "continuations": continuations,
        "reward_mean": round(float(rewards.mean()), 4),
        "reward_std": round(float(rewards.std()), 4),
        "ceiling_explained_var": round(every[0], 3),
        "ceiling_explained_var_last": round(at_last[0], 3),
        "raw_explained_var": round(every[1], 3),
        "raw_explained_var_last": round(at_last[1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("policies", nargs="+", help="exported policy folders (RUN/exports/step_N)")
    parser.add_argument("--values-of", nargs="*", default=[], help="one folder per policy: whose continuations")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--continuations", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.values_of and len(args.values_of) != len(args.policies):
        parser.error(f"--values-of names {len(args.values_of)} folders for {len(args.policies)} policies: one each")
    for policy, values_of in zip(args.policies, args.values_of or args.policies):
        print(json.dumps(ceiling(policy, values_of, args.prompts, args.continuations, args.seed)), flush=True)


if __name__ == "__main__":
    main()
