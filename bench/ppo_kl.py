"""`ppo_kl` against the exact KL on a stale run: does the diagnostic say how far a step's updates moved the policy?

    python -m streamrl.bench.ppo_kl [--steps 30] [--staleness 4] [--seed 0]

The demo's learner (tiny Qwen2, lr 1e-2, groups of 8 of the demo task, 4 groups a step, 24-token completions)
with `learner.mini_batches = 2`, fed as a run at `max_staleness = S` feeds it at its oldest: every step's
samples are drawn (transformers generate, temperature 1) by the weights of S versions before. Update 2 of a
step trains against pi_prox, the weights the step started from, with pi_theta the weights after update 1;
on update 2's tokens this prints, per step, one JSON line with
- `ppo_kl`: the learner's `update/2/ppo_kl` (k3 of pi_theta vs pi_prox, weighted by pi_prox / mu);
- `k1_unweighted`: the mean of log(pi_prox / pi_theta) over the sampled tokens (the estimator it replaced);
- `k3_unweighted`: the mean k3 without the importance weight;
- `exact_kl`: sum_v pi_prox(v) log(pi_prox(v) / pi_theta(v)) at each position, averaged over the same tokens
  (full vocabulary, from plain copies of the two sets of weights);
and a last line `figure: ppo_kl_summary` with their means and each estimator's mean absolute error.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.engine.models import default_tiny_model, load_tokenizer
from streamrl.learner import parallel
from streamrl.learner.advantages import group_advantages
from streamrl.learner.batching import pack
from streamrl.learner.train_step import Trainer
from streamrl.rewards.demo import demo, demo_rows

GROUPS, GROUP_SIZE, MAX_TOKENS = 4, 8, 24


def weights(trainer: Trainer) -> dict:
    """A copy of the trainer's weights (on one CPU rank the state dict holds the live parameters themselves)."""
    return {k: v.detach().clone() for k, v in parallel.full_state_dict(trainer.model).items()}


def plain_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def holding(lm, state: dict):
    """`lm` with `state` loaded (one model object per role, reloaded each step: no read from disk)."""
    lm.load_state_dict(state)
    return lm


def sample_groups(sampler, tokenizer, rows: list[dict], version: int, step: int) -> list[Trajectory]:
    """Each row's group of completions from `sampler`, with behaviour logprobs and the demo reward."""
    out = []
    for g, row in enumerate(rows):
        prompt = tokenizer(row["prompt"])["input_ids"]
        with torch.no_grad():
            gen = sampler.generate(
                torch.tensor([prompt] * GROUP_SIZE),
                attention_mask=torch.ones(GROUP_SIZE, len(prompt), dtype=torch.int64),
                do_sample=True,
                temperature=1.0,
                top_k=0,  # the model's generation config may set 50: sample the plain distribution
                top_p=1.0,
                max_new_tokens=MAX_TOKENS,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        tokens = gen.sequences[:, len(prompt) :]
        logprobs = torch.stack(gen.scores, 1).float().log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)
        for i in range(GROUP_SIZE):
            ids = tokens[i].tolist()
            end = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
            text = tokenizer.decode(ids[:end], skip_special_tokens=True)
            out.append(Trajectory(sample_id=f"{step}-{g}:{i}", group_id=f"{step}-{g}", node_id="bench", seq=0,
                                  prompt_ids=prompt, completion_ids=ids[:end],
                                  behavior_logprobs=logprobs[i, :end].tolist(),
                                  reward=demo([text], [row["answer"]])[0], policy_version=version,
                                  group_size=GROUP_SIZE))  # fmt: skip
    return out


def estimators(prox, theta, micro_batches) -> dict[str, float]:
    """The unweighted k1/k3 and the exact KL(pi_prox || pi_theta) over the micro-batches' loss tokens."""
    k1 = k3 = exact = n = 0.0
    with torch.no_grad():
        for mb in micro_batches:
            if not bool(mb.loss_mask.any()):
                continue
            args = dict(input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], use_cache=False)  # packed
            log_p = prox(**args).logits[0].float().log_softmax(-1)[mb.loss_mask]
            log_q = theta(**args).logits[0].float().log_softmax(-1)[mb.loss_mask]
            targets = mb.targets[mb.loss_mask][:, None]
            log_r = (log_q.gather(1, targets) - log_p.gather(1, targets)).squeeze(1)  # log(pi_theta / pi_prox)
            k1 += (-log_r).sum().item()
            k3 += (torch.expm1(log_r) - log_r).sum().item()
            exact += (log_p.exp() * (log_p - log_q)).sum().item()
            n += float(mb.loss_mask.sum())
    return {"k1_unweighted": k1 / n, "k3_unweighted": k3 / n, "exact_kl": exact / n}


def run(steps: int, staleness: int, seed: int) -> None:
    torch.manual_seed(seed)
    path = str(default_tiny_model())
    tokenizer = load_tokenizer(path)
    device = parallel.init_distributed()
    learner = LearnerConfig(lr=1e-2, mini_batches=2)
    trainer = Trainer(parallel.wrap_model(plain_model(path).train(), learner, device), LossConfig(), learner, device)
    snapshots = {0: weights(trainer)}  # weights by version
    rows = demo_rows(steps * GROUPS, seed=seed)
    sampler, prox, theta = plain_model(path), plain_model(path), plain_model(path)
    measured: dict = {}
    update = trainer._update

    def measuring_update(micro_batches, normalizer, extra):  # before update 2: compare pi_prox and pi_theta
        if measured.get("calls", 0) == 1:
            measured.update(
                estimators(holding(prox, measured["prox"]), holding(theta, weights(trainer)), micro_batches)
            )
        measured["calls"] = measured.get("calls", 0) + 1
        return update(micro_batches, normalizer, extra)

    trainer._update = measuring_update
    lines = []
    for step in range(1, steps + 1):
        start = trainer.version
        version = max(0, start - staleness)
        flat = sample_groups(
            holding(sampler, snapshots[version]), tokenizer, rows[(step - 1) * GROUPS : step * GROUPS], version, step
        )
        groups = [flat[g * GROUP_SIZE : (g + 1) * GROUP_SIZE] for g in range(GROUPS)]
        advantages, _ = group_advantages([[t.reward for t in group] for group in groups])
        measured.clear()
        measured["prox"] = snapshots[start]
        metrics = trainer.step(pack(flat, [a for row in advantages for a in row], token_budget=1024))
        snapshots[trainer.version] = weights(trainer)
        line = {"figure": "ppo_kl", "step": step, "lag": start - version, "ppo_kl": metrics.get("update/2/ppo_kl")}
        line.update({k: measured.get(k) for k in ("k1_unweighted", "k3_unweighted", "exact_kl")})
        line.update(reward_mean=sum(t.reward for t in flat) / len(flat), behavior_kl=metrics["behavior_kl"])
        lines.append(line)
        print(json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in line.items()}), flush=True)
    print(json.dumps(summary(lines, staleness)), flush=True)


def summary(lines: list[dict], staleness: int) -> dict:
    usable = [x for x in lines if x["exact_kl"] is not None and x["ppo_kl"] is not None]
    out = {"figure": "ppo_kl_summary", "staleness": staleness, "steps": len(usable)}
    for key in ("exact_kl", "ppo_kl", "k3_unweighted", "k1_unweighted"):
        values = [x[key] for x in usable]
        out[f"{key}_mean"], out[f"{key}_min"], out[f"{key}_max"] = (
            round(statistics.mean(values), 5), round(min(values), 5), round(max(values), 5))  # fmt: skip
        if key != "exact_kl":
            out[f"{key}_mean_abs_error"] = round(statistics.mean(abs(x[key] - x["exact_kl"]) for x in usable), 5)
    out["finite"] = all(math.isfinite(x["ppo_kl"]) for x in usable)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        run(args.steps, args.staleness, args.seed)
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
