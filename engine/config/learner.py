"""Config sections of the learner: the loss, the optimizer and batching, checkpoints."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from streamrl.engine.config.base import _doc, _Section
from streamrl.engine.config.rejection import RejectionConfig


class LossConfig(_Section):
    """The small config the pure loss functions see (learner/losses.py; formulas in docs/ALGORITHMS.md), and
    the recipes' rules for which samples a step trains (dynamic sampling, truncated completions, the overlong
    penalty: learner/selection.py); `preset` sets a recipe's fields (engine/config/presets.py).

    The default correction is bounded, per token: truncated importance sampling, w = pi_prox / mu
    capped at 3, as the asynchronous anchors bound it (verl's fully-async recipes: token level, cap 2;
    AReaL's behav_imp_weight_cap; prime-rl's token mask) with TRL's cap. A per-sequence weight (TRL's
    synchronous default) is a product over the tokens that shrinks with length x staleness: on the
    demo at max_staleness 4 its reward stayed under 0.7 for 30 steps, where per-token truncation
    reached 0.9 by step 23 (docs/ALGORITHMS.md, "The default, and why").
    """

    clip_low: Annotated[
        float,
        _doc("Ratio lower clip 1 - clip_low (1: no lower bound; gmpo: the log-ratio's, -clip_low).", ge=0.0, le=1.0),
    ] = 0.2
    clip_high: Annotated[
        float, _doc("Ratio upper clip 1 + clip_high (clip-higher when > clip_low; gmpo: the log-ratio's).", ge=0.0)
    ] = 0.28
    surrogate: Annotated[
        Literal["ppo_clip", "cispo", "sapo", "gmpo"],
        _doc(
            "The policy term of the PPO ratio r (learner/surrogates.py): ppo_clip: -min(r A, clip(r) A); cispo: "
            "-sg(clip(r)) A log pi_theta, every token keeps a gradient; sapo: -(4 / tau) sigmoid(tau (r - 1)) A, "
            "a soft gate; gmpo: -A exp(mean of the sequence's clipped log-ratios), the geometric mean (verl geo_mean)."
        ),
    ] = "ppo_clip"
    sapo_tau_pos: Annotated[float, _doc("SAPO's gate temperature for tokens with A > 0 (TRL, verl: 1.0).", gt=0.0)] = (
        1.0
    )
    sapo_tau_neg: Annotated[
        float, _doc("SAPO's gate temperature for tokens with A <= 0 (TRL, verl: 1.05).", gt=0.0)
    ] = 1.05
    dual_clip: Annotated[float, _doc("Dual-clip bound c for negative advantages; 0 disables (else > 1).", ge=0.0)] = 0.0
    ratio_level: Annotated[
        Literal["token", "sequence"],
        _doc(
            "PPO ratio pi_theta / pi_prox per token, or per sequence (GSPO: the geometric mean of the "
            "sequence's token ratios, clipped per sequence; wants clip_low/high near 3e-4/4e-4)."
        ),
    ] = "token"
    aggregation: Annotated[
        Literal["token", "sequence", "constant"],
        _doc(
            "token: mean over all tokens; sequence: mean of per-sequence means; "
            "constant: per-sequence sum / norm_constant, mean over sequences (Dr.GRPO)."
        ),
    ] = "token"
    norm_constant: Annotated[float, _doc("Divisor for aggregation=constant (usually max_tokens).", gt=0.0)] = 1024.0
    importance: Annotated[
        Literal["truncated", "masked", "decoupled", "none"],
        _doc(
            "Off-policy correction w = pi_prox / mu (mu: the rollout policy). truncated (TIS): w clamped "
            "to [is_low, is_high]; masked (MIS): tokens or sequences whose w is outside [is_low, is_high] "
            "get no policy loss; decoupled: w unbounded (only the log-ratio clamp); none: no w, the PPO "
            "ratio is taken against mu."
        ),
    ] = "truncated"
    importance_level: Annotated[
        Literal["token", "sequence"],
        _doc("w per token, or per sequence: exp of the sum of its token log-ratios, one w for all its tokens."),
    ] = "token"
    is_low: Annotated[
        float, _doc("Lower bound on w: masked drops below it, truncated raises to it; 0: no lower bound.", ge=0.0)
    ] = 0.0
    is_high: Annotated[float, _doc("Upper bound on w: masked drops above it, truncated caps at it.", gt=0.0)] = 3.0
    log_ratio_clamp: Annotated[
        float,
        _doc(
            "Every log-ratio (importance weight, PPO ratio, KL) is clamped to +-this before exp, so an "
            "extreme token gives a finite loss and gradient (exp(80) is still finite in fp32).",
            gt=0.0,
            le=80.0,
        ),
    ] = 20.0
    kl_coef: Annotated[
        float,
        _doc(
            "KL penalty to a frozen reference policy (built at start, sharded like the policy); 0 disables "
            "and builds no reference.",
            ge=0.0,
        ),
    ] = 0.0
    reference_path: Annotated[
        str,
        _doc(
            "The reference policy for kl_coef > 0: a local HF model folder (or hub id); empty: model.path "
            "(the weights the run starts from; with LoRA, the policy's own frozen base with its adapters off: "
            "no second model)."
        ),
    ] = ""
    kl_estimator: Annotated[
        Literal["k1", "k2", "k3"],
        _doc(
            "Per-token estimator of KL(pi_theta || ref), r = ref / pi_theta: k1 = -log r, k2 = (log r)^2 / 2, "
            "k3 = r - 1 - log r. With kl_correction each gives its expectation's gradient (k1, k3: that of "
            "KL(pi_theta || ref)); without, the gradient of k3 is KL(ref || pi_theta)'s, k2's KL(pi_theta || ref)'s, "
            "k1's is 0 in expectation (docs/ALGORITHMS.md section 4)."
        ),
    ] = "k3"
    kl_correction: Annotated[
        bool,
        _doc(
            "Weight the reference-KL term by pi_theta / mu (the policy's bounded importance weight pi_prox / mu "
            "times pi_theta / pi_prox, differentiated), so on stale samples its value and gradient are in "
            "expectation those on pi_theta's own samples (TRL use_bias_correction_kl). Off: the term is taken "
            "as if mu's samples were pi_theta's."
        ),
    ] = True
    rejection: Annotated[
        RejectionConfig,
        _doc(
            "Rejection of stale tokens or sequences by a statistic of pi_prox / mu ([loss.rejection]; off by default)."
        ),
    ] = msgspec.field(default_factory=RejectionConfig)
    entropy_coef: Annotated[
        float, _doc("Entropy bonus: the loss minus entropy_coef x the policy entropy of each loss token.", ge=0.0)
    ] = 0.0
    advantage: Annotated[
        Literal[
            "group_mean", "group_std", "leave_one_out", "batch_std", "gae", "reinforce_pp", "reinforce_pp_baseline"
        ],
        _doc(
            "Group-relative estimators (group_mean, group_std, leave_one_out; batch_std: r - mean(group) over the "
            "std of the step's rewards, TRL scale_rewards='batch'); gae: per-token GAE from the "
            "critic's values ([critic]); reinforce_pp: REINFORCE++, returns whitened over the batch; "
            "reinforce_pp_baseline: the group mean subtracted first (learner/critic/, docs/ALGORITHMS.md)."
        ),
    ] = "group_std"
    preset: Annotated[
        Literal["", "grpo", "dapo", "dr_grpo", "gspo", "ppo", "cispo", "sapo", "gmpo"],
        _doc(
            "A recipe: sets the [loss] fields it names (engine/config/presets.py; the table with the verl and "
            "TRL settings in docs/ALGORITHMS.md) where this file or --set does not give them: an explicit field "
            "wins. Applied when the config is built; the learner logs every field it set. Empty: no preset."
        ),
    ] = ""
    dynamic_sampling: Annotated[
        bool,
        _doc(
            "Drop groups with zero reward variance before batching (ledger: dropped:zero_variance) and take "
            "newly admitted groups in their place, so a step keeps learner.groups_per_step groups (verl "
            "filter_groups, AReaL dynamic_sampling)."
        ),
    ] = False
    zero_variance_std: Annotated[
        float,
        _doc(
            "A group has zero variance when the population std of its rewards (after the overlong penalty) is "
            "at most this; 0: when they are all equal (within 1e-6, as the advantages judge it).",
            ge=0.0,
        ),
    ] = 0.0
    refill_limit: Annotated[
        int,
        _doc(
            "dynamic_sampling: replacement groups one step may take, in steps' worth (x learner.groups_per_step); "
            "a step that cannot fill within them trains the groups it has and logs it (0: never replace).",
            ge=0,
        ),
    ] = 3
    mask_truncated: Annotated[
        bool,
        _doc(
            "Completions cut by a length limit (finish_reason length; an episode's max_total_tokens or "
            "max_model_len) get no loss: they still count in their group's advantages, then leave the batch "
            "(ledger: dropped:truncated). TRL mask_truncated_completions."
        ),
    ] = False
    overlong_buffer: Annotated[
        int,
        _doc(
            "DAPO's soft overlong penalty: a completion longer than L - overlong_buffer tokens (L: "
            "rollout.max_tokens, or env.max_total_tokens for episodes) loses overlong_penalty x (excess / "
            "overlong_buffer) of reward, up to overlong_penalty at L; 0 disables.",
            ge=0,
        ),
    ] = 0
    overlong_penalty: Annotated[
        float, _doc("The soft overlong penalty's largest value (DAPO: 1.0), reached at the length limit.", ge=0.0)
    ] = 1.0

    def __post_init__(self) -> None:
        if self.dual_clip > 0 and self.surrogate != "ppo_clip":
            raise ValueError(
                f"loss.dual_clip = {self.dual_clip} applies to surrogate = 'ppo_clip' only (loss.surrogate = "
                f"{self.surrogate!r}); set loss.dual_clip = 0"
            )
        if self.ratio_level == "sequence" and self.surrogate in ("cispo", "gmpo"):
            raise ValueError(
                f"loss.ratio_level = 'sequence' with loss.surrogate = {self.surrogate!r}: cispo weights each token's "
                "own log-prob and gmpo takes its own geometric mean per sequence; use ratio_level = 'token'"
            )
        if 0.0 < self.dual_clip <= 1.0:
            raise ValueError(f"loss.dual_clip = {self.dual_clip} must be > 1 (a bound c on -c*A), or 0 to disable")
        if self.is_low >= self.is_high:
            raise ValueError(
                f"loss.is_low = {self.is_low} must be below loss.is_high = {self.is_high}: "
                "importance weights are kept (masked) or clamped (truncated) inside [is_low, is_high]"
            )


class LearnerConfig(_Section):
    lr: Annotated[float, _doc("AdamW learning rate.", gt=0.0, le=1.0)] = 1e-5
    weight_decay: Annotated[float, _doc("AdamW weight decay.", ge=0.0)] = 0.0
    betas: Annotated[tuple[float, float], _doc("AdamW betas.")] = (0.9, 0.999)
    warmup_steps: Annotated[int, _doc("Linear LR warm-up, in learner steps (batches, not updates).", ge=0)] = 0
    max_grad_norm: Annotated[float, _doc("Gradient clipping norm (on by default; inf disables).", gt=0.0)] = 1.0
    groups_per_step: Annotated[int, _doc("Prompt groups consumed per learner step (one batch).", ge=1)] = 4
    mini_batches: Annotated[
        int,
        _doc(
            "Mini-batches per batch (mini-batch PPO): the batch is split into this many mini-batches of whole "
            "samples, balanced by tokens, and the optimizer updates once on each. Updates per step: "
            "mini_batches x epochs; the clip acts against the weights the batch started from; the policy "
            "version moves once per batch. (Was updates_per_batch.)",
            ge=1,
        ),
    ] = 1
    epochs: Annotated[
        int,
        _doc(
            "Passes over a batch's mini-batches (verl ppo_epochs, TRL num_iterations), every pass against the "
            "same proximal policy, the weights the batch started from.",
            ge=1,
        ),
    ] = 1
    micro_batch_tokens: Annotated[int, _doc("Token budget of one packed micro-batch.", ge=16)] = 8192
    ranks: Annotated[int, _doc("Learner processes (FSDP2 ranks); >1 runs under torchrun.", ge=1)] = 1
    gpus: Annotated[
        list[int], _doc("GPUs of this host for the learner ranks, one per rank; empty: the first learner.ranks.")
    ] = msgspec.field(default_factory=list)
    activation_checkpointing: Annotated[bool, _doc("Recompute activations in backward to save memory.")] = False
    compile: Annotated[
        bool | Literal["auto"],
        _doc("torch.compile each decoder layer; auto: on CUDA (where it is worth its compile time), off on CPU."),
    ] = "auto"
    pad_buckets: Annotated[
        int,
        _doc("Micro-batches are padded to a multiple of micro_batch_tokens / pad_buckets when the model is "
             "compiled (a few static shapes, so nothing recompiles mid-run); 0 never pads.", ge=0),
    ] = 8  # fmt: skip
    fsdp_unit_params: Annotated[
        int,
        _doc(
            "Decoder layers are sharded in FSDP units of at least this many parameters; "
            "a model under it is one unit (one all-gather per step, no per-layer "
            "hooks). Lower it when a whole model does not fit one GPU.",
            ge=1,
        ),
    ] = 1_000_000_000
    head_logits_gib: Annotated[
        float,
        _doc(
            "LM-head logits (one micro-batch, model dtype) kept from forward for "
            "backward, in GiB; past it they are recomputed (one more head matmul). "
            "0 always recomputes.",
            ge=0.0,
        ),
    ] = 16.0

    stall_warn_s: Annotated[
        float,
        _doc(
            "No sample trained for this long: the learner logs why (drop reasons and counts since the last "
            "trained step) and repeats it as long as the stall lasts.",
            gt=0.0,
        ),
    ] = 120.0
    stall_stop_s: Annotated[
        float,
        _doc(
            "No sample trained for this long: the learner stops with an error (exit 3) naming the reasons; "
            "0 never stops. Counted from the learner's start too, so it must cover the nodes' start-up.",
            ge=0.0,
        ),
    ] = 1800.0

    def __post_init__(self) -> None:
        if 0.0 < self.stall_stop_s < self.stall_warn_s:
            raise ValueError(
                f"learner.stall_stop_s = {self.stall_stop_s:g} is below learner.stall_warn_s = "
                f"{self.stall_warn_s:g}: the run would stop before it warned; raise stall_stop_s or set it to 0"
            )


class CheckpointConfig(_Section):
    every: Annotated[
        int,
        _doc(
            "Save a resumable checkpoint every N steps (and at the last); 0: as often as checkpoint.budget allows "
            "(the default: a crash can be resumed with --resume latest).",
            ge=0,
        ),
    ] = 0
    budget: Annotated[
        float,
        _doc(
            "With every = 0, the most of the run's time checkpoints may take: the next waits until the time since "
            "the last one is at least its duration / budget (and min_interval_s); 0: no checkpoints.",
            ge=0.0,
            le=0.5,
        ),
    ] = 0.02
    min_interval_s: Annotated[
        float, _doc("With every = 0, the least time between two checkpoints (the first: from the start).", gt=0.0)
    ] = 60.0
    keep_last: Annotated[int, _doc("Keep the newest K checkpoints.", ge=1)] = 2
    keep_every: Annotated[int, _doc("Also keep every checkpoint whose step is a multiple of M; 0 disables.", ge=0)] = 0
    export_every: Annotated[int, _doc("Write an HF safetensors export every N steps; 0 disables.", ge=0)] = 0
