"""Rules across config sections, checked in one place before any process starts.

Each field is validated alone when the config is built (engine/config/schema.py); what no single field can
know lives here: a sample the learner could not pack, ranks with nothing to train, a mini-batch with
no sample, a reference model that would never be used. `ops/preflight.py` reports these findings and
`learner/main.py` refuses to start on an error, so neither can disagree with the other, and nothing
that can be known at start fails mid-run (after nodes generated a batch).

    for finding in config_rules.check(cfg, roles=("learner",)): print(finding)  # "error: ..."
    config_rules.require(cfg, roles=("learner",))  # raises ConfigError on the first error
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, NamedTuple

from streamrl.engine.config.critic import critic_on
from streamrl.engine.config.presets import completion_limit
from streamrl.engine.config.schema import Config, ConfigError

ROLES = ("learner", "rollout")


class Finding(NamedTuple):
    level: Literal["error", "warning"]
    message: str  # names the fields, their values and the fix

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


def longest_sample(cfg: Config) -> tuple[int, str]:
    """Positions (tokens - 1) of the longest sample the nodes can send, and how that was reckoned.

    Generation stops at model.max_model_len (the engines cap max_tokens to the room left), so a sample
    is at most that long; below it, a prompt (data.max_prompt_tokens) plus a completion
    (rollout.max_tokens, or for a multi-turn episode env.max_total_tokens after the first prompt).
    """
    after_prompt, name = (
        (cfg.env.max_total_tokens, "env.max_total_tokens")
        if cfg.env.name
        else (cfg.rollout.max_tokens, "rollout.max_tokens")
    )
    tokens = min(cfg.model.max_model_len, cfg.data.max_prompt_tokens + after_prompt)
    return tokens - 1, f"min(model.max_model_len, data.max_prompt_tokens + {name}) - 1"


def check(cfg: Config, roles: Iterable[str] = ROLES) -> list[Finding]:
    """Every cross-section finding for a run of `roles` (the learner's rules only when it is among them)."""
    roles = frozenset(roles)
    out = _lengths(cfg, roles)
    if "learner" in roles:
        out += _learner(cfg) + _critic(cfg)
    return out


def require(cfg: Config, roles: Iterable[str] = ROLES) -> list[Finding]:
    """Raise ConfigError naming every error; return the warnings (for the caller to log)."""
    findings = check(cfg, roles)
    errors = [f.message for f in findings if f.level == "error"]
    if errors:
        raise ConfigError("; ".join(errors))
    return findings


def _lengths(cfg: Config, roles: frozenset[str]) -> list[Finding]:
    out = []
    if cfg.data.max_prompt_tokens >= cfg.model.max_model_len:
        out.append(
            f"data.max_prompt_tokens = {cfg.data.max_prompt_tokens} leaves no room to generate under "
            f"model.max_model_len = {cfg.model.max_model_len}; lower it or raise model.max_model_len"
        )
    longest, how = longest_sample(cfg)
    if "learner" in roles and cfg.learner.micro_batch_tokens < longest:
        out.append(
            f"learner.micro_batch_tokens = {cfg.learner.micro_batch_tokens} is below the longest sample "
            f"({longest} positions: {how}), which the learner could not pack; raise it to at least {longest} "
            "or lower the lengths"
        )
    return [Finding("error", m) for m in out]


def _learner(cfg: Config) -> list[Finding]:
    learner, loss = cfg.learner, cfg.loss
    errors, warnings = [], []
    if cfg.ledger.on_node_lost == "readmit":
        errors.append(
            "ledger.on_node_lost = 'readmit': rollout nodes do not yet re-generate a lost node's "
            "groups, so their credits would never return; use 'drop'"
        )
    samples = learner.groups_per_step * cfg.rollout.group_size
    if learner.ranks > samples:
        errors.append(
            f"learner.ranks = {learner.ranks} exceeds the samples of a step "
            f"(learner.groups_per_step x rollout.group_size = {samples}): some ranks would idle"
        )
    if learner.mini_batches > samples:
        errors.append(
            f"learner.mini_batches = {learner.mini_batches} exceeds the samples of a step "
            f"(learner.groups_per_step x rollout.group_size = {samples}): a mini-batch holds whole samples, "
            f"so some updates would have none; lower it to at most {samples} or raise learner.groups_per_step"
        )
    limit = completion_limit(cfg)
    if loss.overlong_buffer > limit:
        errors.append(
            f"loss.overlong_buffer = {loss.overlong_buffer} exceeds the longest completion ({limit} tokens: "
            f"{'env.max_total_tokens' if cfg.env.name else 'rollout.max_tokens'}), so every completion would be "
            "penalised; lower it (DAPO uses a fifth of the limit) or set it to 0"
        )
    if loss.ratio_level == "sequence" and learner.mini_batches * learner.epochs == 1:
        warnings.append(
            "loss.ratio_level = 'sequence' (GSPO) with one update per step: the ratio is exactly 1 there, so "
            "GSPO's sequence clip never acts; raise learner.mini_batches (GSPO's paper: 4) or learner.epochs"
        )
    if loss.surrogate != "ppo_clip" and learner.mini_batches * learner.epochs == 1:
        warnings.append(
            f"loss.surrogate = {loss.surrogate!r} with one update per step: the ratio is exactly 1 there, so the "
            "gradient is PPO-clip's; it differs from a step's second update on: raise learner.mini_batches or epochs"
        )
    if loss.reference_path and loss.kl_coef == 0 and cfg.critic.kl_in_reward == 0:
        warnings.append(
            f"loss.reference_path = {loss.reference_path!r} but loss.kl_coef = 0: no reference model is built; "
            "set loss.kl_coef > 0 to use it, or leave loss.reference_path empty"
        )
    return [Finding("error", m) for m in errors] + [Finding("warning", m) for m in warnings]


GROUP_BASELINES = ("group_mean", "group_std", "leave_one_out", "batch_std", "reinforce_pp_baseline")


def _critic(cfg: Config) -> list[Finding]:
    """The critic and GAE go together; a group of one needs an estimator that is not its own baseline."""
    advantage, on, errors = cfg.loss.advantage, critic_on(cfg.critic.enabled, cfg.loss.advantage), []
    if advantage == "gae" and not on:
        errors.append("loss.advantage = 'gae' needs the critic's values: set critic.enabled = true (or 'auto')")
    if on and advantage != "gae":
        errors.append(
            f"critic.enabled = true but loss.advantage = {advantage!r}: only GAE uses the critic's values; "
            "set loss.advantage = 'gae' (loss.preset = 'ppo'), or critic.enabled = 'auto'"
        )
    if cfg.rollout.group_size == 1 and advantage in GROUP_BASELINES:
        errors.append(
            f"rollout.group_size = 1 with loss.advantage = {advantage!r}: a group of one is its own baseline, so "
            "every advantage is 0; use loss.preset = 'ppo' (a critic) or loss.advantage = 'reinforce_pp'"
        )
    if cfg.critic.kl_in_reward and advantage not in ("gae", "reinforce_pp", "reinforce_pp_baseline"):
        errors.append(
            f"critic.kl_in_reward = {cfg.critic.kl_in_reward} with loss.advantage = {advantage!r}: only the per-token "
            "estimators (gae, reinforce_pp, reinforce_pp_baseline) take a KL in the reward; use loss.kl_coef instead"
        )
    if cfg.critic.kl_ctrl == "adaptive" and not cfg.critic.kl_in_reward:
        errors.append(
            "critic.kl_ctrl = 'adaptive' with critic.kl_in_reward = 0: the controller moves the coefficient of a KL "
            "penalty in the reward, and kl_in_reward is where it starts (verl kl_ctrl.kl_coef, OpenRLHF "
            "init_kl_coef); set critic.kl_in_reward > 0 (e.g. 0.001), or critic.kl_ctrl = 'fixed'"
        )
    if cfg.rollout.group_size == 1 and cfg.loss.dynamic_sampling:
        errors.append(
            "loss.dynamic_sampling with rollout.group_size = 1: a group of one never has reward variance, so every "
            "group would be dropped; set loss.dynamic_sampling = false (a critic needs no group)"
        )
    return [Finding("error", m) for m in errors] + [Finding("warning", m) for m in _kl_ctrl_unread(cfg.critic)]


def _kl_ctrl_unread(critic) -> list[str]:
    """kl_target / kl_horizon moved from their defaults where no adaptive controller reads them."""
    defaults = type(critic)()
    moved = [f for f in ("kl_target", "kl_horizon") if getattr(critic, f) != getattr(defaults, f)]
    if critic.kl_ctrl == "adaptive" or not moved:
        return []
    fields = ", ".join(f"critic.{f}" for f in moved)
    return [f"{fields} set but critic.kl_ctrl = 'fixed': only the adaptive controller reads it; set it 'adaptive'"]
