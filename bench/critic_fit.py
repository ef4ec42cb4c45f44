"""Can the critic learn a reward it can see? The value model alone, on fresh random completions every step.

    python -m streamrl.bench.critic_fit [--lr 3e-3] [--epochs 2] [--steps 40] [--samples 32] [--every 5]
                                        [--lam-critic 1.0]

The tiny model's critic (head at 0) trains on 32 completions of 12 tokens a step, each token the id 7 with
probability 0.3, else uniform; the reward is the share of 7s. The explained variance is measured, as in a run,
on each step's new samples before the critic trains on them. A positive control for the demo's figures
(bench/RESULTS.md, issue 50): there the reward is the share of one letter among a completion's characters.
One JSON line every `--every` steps (`figure: critic_fit`), with the ceiling: the explained variance of
the best value there is, E[reward | the tokens seen] = (7s seen + SHARE' x tokens unseen) / LENGTH (SHARE'
counts a 7 drawn uniformly too). At the k-th loss token k of 12 tokens are seen, so it explains k/12 of the
reward's variance: 11/12 at the last token, 5.5/12 = 0.46 over all tokens (the residual is the unseen tokens').
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from streamrl.engine.config import LearnerConfig, LossConfig
from streamrl.engine.config.critic import CriticConfig
from streamrl.engine.messages import Trajectory
from streamrl.engine.models import default_tiny_model
from streamrl.learner import parallel
from streamrl.learner.batching import pack
from streamrl.learner.critic.model import load_value_net, wrap_value_model
from streamrl.learner.critic.trainer import Shaper

TOKEN, SHARE, LENGTH = 7, 0.3, 12
P_TOKEN = SHARE + (1 - SHARE) / 497  # a uniform draw from 3..499 is a 7 too


def batch(rng: random.Random, n: int):
    trajectories, scores = [], []
    for i in range(n):
        completion = [TOKEN if rng.random() < SHARE else rng.randrange(3, 500) for _ in range(LENGTH)]
        trajectories.append(
            Trajectory(sample_id=f"s{i}", group_id=f"g{i}", node_id="n", seq=i,
                       prompt_ids=[rng.randrange(3, 500) for _ in range(4)], completion_ids=completion,
                       behavior_logprobs=[-6.0] * LENGTH, reward=0.0, policy_version=0)
        )  # fmt: skip
        scores.append(completion.count(TOKEN) / LENGTH)
    return pack(trajectories, scores, token_budget=1 << 14)


def ceiling(micro_batches) -> dict[str, float]:
    """Explained variance of E[reward | prefix] over every loss token and at the last: the best any critic gets."""
    best, reward, last = [], [], []
    for mb in micro_batches:
        cu = mb.cu_seqlens.tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            completion = mb.targets[start:end][mb.loss_mask[start:end]].tolist()
            share = completion.count(TOKEN) / LENGTH
            for k in range(LENGTH):
                best.append((completion[:k].count(TOKEN) + (LENGTH - k) * P_TOKEN) / LENGTH)
                reward.append(share)
                last.append(k == LENGTH - 1)
    best, reward, last = torch.tensor(best), torch.tensor(reward), torch.tensor(last)

    def explained(keep):
        return round(float(1 - (reward[keep] - best[keep]).var() / reward[keep].var()), 3)

    return {"ceiling_explained_var": explained(torch.ones_like(last)), "ceiling_explained_var_last": explained(last)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--lam-critic", type=float, default=1.0, help="critic.lam_critic (the targets' lambda)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="critic.weight_decay")
    args = parser.parse_args()
    device = parallel.init_distributed()
    torch.manual_seed(0)
    loss = LossConfig(advantage="gae", aggregation="token")
    critic = CriticConfig(lr=args.lr, epochs=args.epochs, lam_critic=args.lam_critic, weight_decay=args.weight_decay)
    model = wrap_value_model(load_value_net(str(default_tiny_model())), LearnerConfig(), device)
    shaper, rng = Shaper(model, critic, loss, device), random.Random(0)
    for step in range(1, args.steps + 1):
        micro_batches = batch(rng, args.samples)
        tokens = float(sum(mb.num_loss_tokens for mb in micro_batches))
        out = shaper.train(shaper.advantages([micro_batches]), [tokens], 1)
        if step % args.every == 0:
            shown = {k.removeprefix("critic/"): round(v, 3) for k, v in out.items() if "explained" in k or "loss" in k}
            line = {"figure": "critic_fit", "step": step, "lr": args.lr, "epochs": args.epochs}
            line |= {"lam_critic": args.lam_critic, "weight_decay": args.weight_decay, **shown}
            print(json.dumps(line | ceiling(micro_batches)), flush=True)
    parallel.shutdown()


if __name__ == "__main__":
    main()
