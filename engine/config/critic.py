"""The [critic] section: PPO's value model and GAE (learner/critic/; formulas in docs/ALGORITHMS.md, "Critic")."""

from __future__ import annotations

from typing import Annotated, Literal

from streamrl.engine.config.base import _doc, _Section


class CriticConfig(_Section):
    """A value model on the learner ranks beside the actor: the actor's architecture with a scalar head, sharded
    like it, with its own optimizer. Its values, computed at training time on each rank, make per-token GAE
    advantages (loss.advantage = "gae") and lambda-returns, its targets. The defaults are loss.preset = "ppo"'s:
    gamma 1.0, lambda 0.95 for the actor and 1.0 for the critic (VC-PPO's decoupled GAE)."""

    enabled: Annotated[
        bool | Literal["auto"],
        _doc("Build and train the critic; auto: where loss.advantage = 'gae' (which needs it, as it needs GAE)."),
    ] = "auto"
    path: Annotated[
        str,
        _doc(
            "Where the value model starts: a causal LM folder (its body; the scalar head starts at 0) or a "
            "reward model's folder (a sequence-classification model with one label: body and head); empty: "
            "model.path, the actor's starting weights."
        ),
    ] = ""
    lora: Annotated[
        bool | Literal["auto"],
        _doc(
            "Train the critic as LoRA adapters (the [lora] section's rank, alpha and target modules) and its head "
            "on a frozen copy of its base in model.dtype, as verl's and OpenRLHF's LoRA critics are; auto: "
            "where the actor is LoRA. A full critic keeps 16 bytes a parameter on the learner (7B: 128 GiB on "
            "one GPU); this one 2 and the adapters' 16."
        ),
    ] = "auto"
    lr: Annotated[float, _doc("The critic's AdamW learning rate (verl critic.optim.lr).", gt=0.0, le=1.0)] = 1e-5
    weight_decay: Annotated[float, _doc("The critic's AdamW weight decay.", ge=0.0)] = 0.0
    max_grad_norm: Annotated[float, _doc("The critic's gradient clipping norm (inf disables).", gt=0.0)] = 1.0
    warmup_steps: Annotated[
        int,
        _doc(
            "The first N steps train the critic alone; the actor waits (no update, no new version: the "
            "samples end as dropped:no_gradient). verl trainer.critic_warmup, OpenRLHF freezing_actor_steps.",
            ge=0,
        ),
    ] = 0
    epochs: Annotated[
        int,
        _doc(
            "The critic's passes over a step's mini-batches (one update each; verl critic.ppo_epochs); 0: "
            "learner.epochs, as the actor.",
            ge=0,
        ),
    ] = 0
    value_clip: Annotated[
        float,
        _doc(
            "Clip the value's move from the values the advantages were made from to +-this in the loss (verl "
            "critic.cliprange_value, OpenRLHF value_clip); 0 disables.",
            ge=0.0,
        ),
    ] = 0.5
    gamma: Annotated[float, _doc("Discount per token of GAE (and of REINFORCE++'s returns).", ge=0.0, le=1.0)] = 1.0
    lam_actor: Annotated[float, _doc("GAE lambda of the actor's advantages.", ge=0.0, le=1.0)] = 0.95
    lam_critic: Annotated[
        float,
        _doc("GAE lambda of the critic's targets (the lambda-returns); 1.0: the Monte-Carlo return.", ge=0.0, le=1.0),
    ] = 1.0
    kl_in_reward: Annotated[
        float,
        _doc(
            "Per-token KL penalty in the reward of the per-token estimators (gae, reinforce_pp*): "
            "kl_in_reward x (log mu - log pi_ref) subtracted at every loss token (verl algorithm.use_kl_in_reward "
            "with kl_ctrl.kl_coef, OpenRLHF init_kl_coef); builds the reference model (loss.reference_path); "
            "0: off. With kl_ctrl = 'adaptive', where the coefficient starts.",
            ge=0.0,
        ),
    ] = 0.0
    kl_ctrl: Annotated[
        Literal["fixed", "adaptive"],
        _doc(
            "How kl_in_reward's coefficient moves: fixed, or adaptive (Ziegler et al.'s controller: after each "
            "step beta x= 1 + clip(KL / kl_target - 1, -0.2, 0.2) x completions / kl_horizon; verl "
            "algorithm.kl_ctrl.type, OpenRLHF kl_target set, TRL adap_kl_ctrl). Kept in checkpoints."
        ),
    ] = "fixed"
    kl_target: Annotated[
        float,
        _doc(
            "The adaptive controller's target: the step's mean over completions of each one's mean KL per loss "
            "token (verl kl_ctrl.target_kl, OpenRLHF kl_target; TRL's target is per completion, not per token).",
            gt=0.0,
        ),
    ] = 0.1
    kl_horizon: Annotated[
        int,
        _doc(
            "The adaptive controller's horizon in completions: the larger, the slower beta moves (verl "
            "kl_ctrl.horizon, OpenRLHF kl_horizon, TRL horizon).",
            ge=1,
        ),
    ] = 10000
    whiten_advantages: Annotated[
        bool, _doc("Whiten the actor's GAE advantages over the step's loss tokens on every rank (verl does).")
    ] = True


def critic_on(enabled: bool | str, advantage: str) -> bool:
    """Whether the learner builds a critic: `critic.enabled`, where auto follows loss.advantage = 'gae'."""
    return advantage == "gae" if enabled == "auto" else bool(enabled)


def critic_lora(cfg) -> bool:
    """Whether the critic (where there is one) trains LoRA adapters and its head on a frozen base: `critic.lora`,
    where auto follows the actor ([lora] enabled)."""
    return cfg.lora.enabled if cfg.critic.lora == "auto" else bool(cfg.critic.lora)
