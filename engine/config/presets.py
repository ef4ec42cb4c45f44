"""`loss.preset`: the [loss] settings of a published recipe, under one name.

A preset fills the fields it names where the config (the TOML file and `--set`) does not give them, so an
explicit field always wins; it is applied when the config is built (`schema.build`), and the learner logs
every field with where it came from (`describe`). Every preset names the same fields, so switching
presets never leaves one recipe's setting behind; the off-policy correction (`importance`, `is_*`), the
reference KL and the entropy bonus are left alone (the recipes are synchronous, or set them apart).

- grpo: DeepSeekMath's GRPO, mean of per-sequence means, symmetric clip (TRL `loss_type="grpo"`);
- dapo: DAPO, clip-higher, token mean, dynamic sampling, soft overlong penalty (verl's recipe/dapo);
- dr_grpo: Dr. GRPO, no std scaling, per-sequence sums over a constant (TRL `loss_type="dr_grpo"`);
- gspo: GSPO, the sequence's geometric-mean ratio clipped at 3e-4 / 4e-4 (verl `loss_mode=gspo`);
- ppo: PPO with a critic (verl `adv_estimator=gae`): per-token GAE, token mean, clip 0.2; the critic's
  gamma / lambdas are [critic]'s defaults (engine/config/critic.py: 1.0, 0.95 actor, 1.0 critic), printed here.
- cispo: ScaleRL's recipe as TRL's paper index spells it (`loss_type="cispo"`, `epsilon_high=5.0`,
  `scale_rewards="batch"`): the clipped ratio as a stopped weight, capped at 5, no lower bound;
- sapo: SAPO's soft gate, temperatures 1.0 / 1.05, mean of per-sequence means (TRL `loss_type="sapo"`);
- gmpo: GMPO, the geometric mean of the token ratios clipped at exp(+-0.4) (verl `loss_mode=geo_mean`,
  `examples/gmpo_trainer`).

docs/ALGORITHMS.md has the full table (each field, and where a peer's setting differs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamrl.engine.config.schema import Config

# The fields every preset sets; a preset's values for the two that depend on the lengths are filled by `values`.
FIELDS = (
    "advantage",
    "aggregation",
    "norm_constant",
    "clip_low",
    "clip_high",
    "ratio_level",
    "dynamic_sampling",
    "mask_truncated",
    "overlong_buffer",
    "overlong_penalty",
    "surrogate",
    "sapo_tau_pos",
    "sapo_tau_neg",
)

_COMMON = {"ratio_level": "token", "dynamic_sampling": False, "mask_truncated": False, "overlong_buffer": 0,
           "overlong_penalty": 1.0, "clip_low": 0.2, "surrogate": "ppo_clip", "sapo_tau_pos": 1.0,
           "sapo_tau_neg": 1.05}  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {**_COMMON, "advantage": "group_std", "aggregation": "sequence", "clip_high": 0.2},
    # DAPO's recipe: a buffer of 4096 of 20480 response tokens (a fifth), penalty 1.0; no overlong filtering
    # (its authors found the shaping covers it), no KL.
    "dapo": {**_COMMON, "advantage": "group_std", "aggregation": "token", "clip_high": 0.28,
             "dynamic_sampling": True, "overlong_buffer": "max_tokens/5"},
    "dr_grpo": {**_COMMON, "advantage": "group_mean", "aggregation": "constant", "clip_high": 0.2,
                "norm_constant": "max_tokens"},
    "gspo": {**_COMMON, "advantage": "group_std", "aggregation": "sequence", "ratio_level": "sequence",
             "clip_low": 3e-4, "clip_high": 4e-4},
    "ppo": {**_COMMON, "advantage": "gae", "aggregation": "token", "clip_high": 0.2},
    # TRL's epsilon_high = 5.0 caps the ratio itself at 5 (here 1 + clip_high); no lower bound (clip_low = 1)
    "cispo": {**_COMMON, "surrogate": "cispo", "advantage": "batch_std", "aggregation": "token", "clip_low": 1.0,
              "clip_high": 4.0},
    "sapo": {**_COMMON, "surrogate": "sapo", "advantage": "group_std", "aggregation": "sequence", "clip_high": 0.2},
    # verl's geo_mean takes the mean over sequences whatever loss_agg_mode says; its example clips the log-ratio at 0.4
    "gmpo": {**_COMMON, "surrogate": "gmpo", "advantage": "group_std", "aggregation": "sequence", "clip_low": 0.4,
             "clip_high": 0.4},
}  # fmt: skip


def completion_limit(cfg: Config) -> int:
    """Most tokens a sample's completion can have: rollout.max_tokens, or env.max_total_tokens for episodes
    (both under model.max_model_len less a prompt): the L of the overlong penalty and Dr. GRPO's constant."""
    return cfg.env.max_total_tokens if cfg.env.name else cfg.rollout.max_tokens


def values(preset: str, cfg: Config) -> dict[str, Any]:
    """Every field `preset` sets, with the length-dependent ones worked out for `cfg`."""
    limit = completion_limit(cfg)
    out = {"norm_constant": float(limit), **PRESETS[preset]}
    derived = {"max_tokens": float(limit), "max_tokens/5": max(1, limit // 5)}
    return {k: derived.get(v, v) if isinstance(v, str) else v for k, v in out.items()}


def apply(data: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """The raw config `data` with `cfg.loss.preset`'s values for every [loss] field `data` does not give."""
    if not cfg.loss.preset:
        return data
    loss = dict(data.get("loss", {}))
    for field, value in values(cfg.loss.preset, cfg).items():
        loss.setdefault(field, value)
    return {**data, "loss": loss}


def describe(cfg: Config) -> str:
    """One line: the preset and each field it names, marked where an explicit setting overrode it."""
    if not cfg.loss.preset:
        return "loss.preset: none (every [loss] field as configured)"
    parts, preset = [], values(cfg.loss.preset, cfg)
    for field in FIELDS:
        value, actual = preset[field], getattr(cfg.loss, field)
        parts.append(f"{field} = {actual!r}" + ("" if actual == value else f" (explicit; the preset's {value!r})"))
    if cfg.loss.advantage == "gae":  # the critic's half of the recipe (engine/config/critic.py)
        c = cfg.critic
        parts.append(f"critic.gamma = {c.gamma!r}, critic.lam_actor = {c.lam_actor!r}, critic.lam_critic = "
                     f"{c.lam_critic!r}, critic.value_clip = {c.value_clip!r}, kl in reward: off")  # fmt: skip
    return f"loss.preset = {cfg.loss.preset!r}: " + ", ".join(parts)
