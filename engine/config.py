"""Typed configuration: one Struct per component, loaded from TOML plus dotted overrides.

Every field carries its documentation in `Meta(description=...)` and its allowed range in
`Meta(ge=..., le=...)`, so a bad value fails when the config is built with an error that names
the field's path, the value and what is allowed (`ConfigError`). Unknown keys are errors too:
a typo never silently falls back to a default.
"""

from __future__ import annotations

import pathlib
import re
import tomllib
import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class ConfigError(ValueError):
    """A config value or key that is not allowed; the message names the field path."""


def _doc(text: str, **bounds: Any) -> Meta:
    return Meta(description=text, **bounds)


PosInt = Annotated[int, Meta(ge=1)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class RunConfig(_Section):
    name: Annotated[
        str,
        _doc("Run id; Redis keys and the run folder are named after it.", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$"),
    ] = "demo"
    dir: Annotated[str, _doc("Folder that holds every run's folder (logs, metrics, checkpoints).")] = "runs"
    seed: Annotated[int, _doc("Seed for model init, sampling and data order.", ge=0)] = 0
    device: Annotated[
        Literal["auto", "cpu", "cuda"],
        _doc("Where the learner and the rollout engines run; auto picks cuda when present."),
    ] = "auto"
    steps: Annotated[int, _doc("Optimizer steps to run before stopping.", ge=1)] = 20

    @property
    def path(self) -> pathlib.Path:
        return pathlib.Path(self.dir) / self.name


class ModelConfig(_Section):
    path: Annotated[
        str,
        _doc(
            "Local HF model folder (or hub id where a hub is reachable). "
            "Empty: the built-in tiny model, made on first use."
        ),
    ] = ""
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        _doc("Parameter dtype of the rollout engines and the learner's compute."),
    ] = "float32"
    trust_remote_code: Annotated[bool, _doc("Run code shipped with the model; off unless the model needs it.")] = False
    max_model_len: Annotated[int, _doc("Longest prompt + completion in tokens.", ge=16, le=1 << 20)] = 512


class DataConfig(_Section):
    path: Annotated[
        str, _doc("Prompt file (.jsonl, .parquet) or a saved HF dataset folder. Empty: the built-in demo task.")
    ] = ""
    prompt_column: Annotated[str, _doc("Column holding the prompt text.")] = "prompt"
    messages_column: Annotated[str, _doc("Column holding chat messages; used with the chat template when present.")] = (
        "messages"
    )
    answer_column: Annotated[str, _doc("Column passed to rewards as the reference answer.")] = "answer"
    max_prompt_tokens: Annotated[int, _doc("Longer prompts are skipped and counted.", ge=1)] = 256
    loop: Annotated[bool, _doc("Start again when the source is exhausted instead of ending.")] = True
    shuffle: Annotated[bool, _doc("Shuffle rows (seeded by run.seed).")] = True


class RolloutConfig(_Section):
    backend: Annotated[
        Literal["vllm", "hf"], _doc("Generation engine: vllm, or hf (transformers generate) where vLLM is absent.")
    ] = "vllm"
    group_size: Annotated[
        int, _doc("Completions sampled per prompt; one group for advantage estimation.", ge=1, le=1024)
    ] = 4
    max_tokens: Annotated[int, _doc("Most completion tokens per sample.", ge=1)] = 32
    temperature: Annotated[
        float, _doc("Sampling temperature; behavior logprobs are of this distribution.", gt=0.0, le=10.0)
    ] = 1.0
    top_p: Annotated[float, _doc("Nucleus sampling mass; 1.0 keeps the full distribution.", gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, _doc("Sample among the k likeliest tokens; 0 disables.", ge=0)] = 0
    max_concurrent_groups: Annotated[int, _doc("Groups one node generates at once (bounded by credits too).", ge=1)] = 8
    kv_cache_gib: Annotated[
        float, _doc("KV cache size per vLLM engine in GiB (explicit: the CPU default reserves ~9 GiB).", gt=0.0)
    ] = 0.25
    gpu_memory_utilization: Annotated[float, _doc("vLLM's GPU memory share (CUDA only).", gt=0.0, le=1.0)] = 0.5
    enforce_eager: Annotated[bool, _doc("Skip CUDA graphs / compilation in vLLM (fast start).")] = True
    gpus: Annotated[
        list[int],
        _doc("GPUs the rollout nodes of `streamrl run` take, round robin; empty: those the learner leaves free."),
    ] = msgspec.field(default_factory=list)
    share_learner_gpus: Annotated[
        bool, _doc("Let rollout nodes run on the learner's GPUs (refused otherwise: the roles would compete).")
    ] = False


class RewardModelConfig(_Section):
    """A local HF reward model, used when `reward_model` is among reward.functions.

    score = clip(transform(raw * scale + shift), clip_low, clip_high), where raw is one logit:
    output `index` of a sequence classifier, or the logit of token `index` (or of `token`) at the
    last position of a causal LM.
    """

    path: Annotated[str, _doc("Local HF folder of the reward model.")] = ""
    kind: Annotated[
        Literal["sequence_classification", "causal_lm"],
        _doc(
            "sequence_classification: AutoModelForSequenceClassification; causal_lm: a token's "
            "logit at the last position."
        ),
    ] = "sequence_classification"
    index: Annotated[
        int, _doc("Class index (sequence_classification) or token id (causal_lm) whose logit is the raw score.", ge=0)
    ] = 0
    token: Annotated[str, _doc("causal_lm only: the token whose logit is the score (overrides index), e.g. 'Yes'.")] = (
        ""
    )
    transform: Annotated[Literal["none", "sigmoid", "tanh"], _doc("Squashing applied after scale and shift.")] = "none"
    scale: Annotated[float, _doc("Multiplies the raw score before the transform.")] = 1.0
    shift: Annotated[float, _doc("Added after scaling, before the transform.")] = 0.0
    clip_low: Annotated[
        float, _doc("Scores are clipped to at least this; also the low end of the range checked at start.")
    ] = -10.0
    clip_high: Annotated[
        float, _doc("Scores are clipped to at most this; also the high end of the range checked at start.")
    ] = 10.0
    batch_size: Annotated[int, _doc("Samples per forward pass.", ge=1)] = 16
    max_length: Annotated[int, _doc("Prompt + completion tokens kept (truncated from the left).", ge=8)] = 1024
    device: Annotated[str, _doc("Device of the reward model; auto: cuda when present, else cpu.")] = "auto"
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], _doc("Reward model parameter dtype.")] = "float32"

    def __post_init__(self) -> None:
        if self.clip_low >= self.clip_high:
            raise ValueError(f"reward.model.clip_low = {self.clip_low} must be below clip_high = {self.clip_high}")


class RewardConfig(_Section):
    functions: Annotated[
        list[str], _doc("Reward functions by registry name, `module:function` or `path.py:function`.", min_length=1)
    ] = msgspec.field(default_factory=lambda: ["demo"])
    weights: Annotated[list[float], _doc("One weight per function; empty means all 1.0.")] = msgspec.field(
        default_factory=list
    )
    timeout_s: Annotated[float, _doc("Per-call deadline; a call past it is killed and gives None.", gt=0.0)] = 10.0
    workers: Annotated[
        int,
        _doc(
            "Reward worker processes per rollout node; 0 runs rewards inline (no timeout can be enforced then).", ge=0
        ),
    ] = 1
    start_method: Annotated[
        Literal["forkserver", "spawn"],
        _doc("How pool workers start; never fork (the rollout process holds vLLM threads)."),
    ] = "forkserver"
    regex: Annotated[str, _doc("Pattern of the `regex` reward (re.search, DOTALL): 1.0 when it matches.")] = ""
    length_target_tokens: Annotated[
        int, _doc("`length_penalty`: completions longer than this lose 1/target per extra token, down to -1.", ge=1)
    ] = 256
    math_timeout_s: Annotated[int, _doc("`math`: math-verify's own parse/verify alarm, in whole seconds.", ge=1)] = 5
    model: Annotated[
        RewardModelConfig, _doc("The reward model scored when `reward_model` is among reward.functions.")
    ] = msgspec.field(default_factory=RewardModelConfig)

    def __post_init__(self) -> None:
        if self.weights and len(self.weights) != len(self.functions):
            raise ValueError(
                f"reward.weights has {len(self.weights)} entries but reward.functions has "
                f"{len(self.functions)}; give one weight per function or none"
            )


class EnvConfig(_Section):
    """Multi-turn episodes (rollout/envs): when `name` is set, a group is `rollout.group_size` episodes of
    one row with an environment that answers each model turn; its step rewards, summed, are the reward."""

    name: Annotated[
        str,
        _doc(
            "Environment: a registered name (echo_target, tools, reasoning_gym, skyrl_gym), `module:Class` or "
            "`path.py:Class`. Empty: single-turn groups scored by reward.functions."
        ),
    ] = ""
    args: Annotated[dict[str, Any], _doc("Keyword arguments of the environment's constructor (one per episode).")] = (
        msgspec.field(default_factory=dict)
    )
    tools: Annotated[
        list[str], _doc("Tool callables run in worker processes (calculator, `module:function`, `path.py:function`).")
    ] = msgspec.field(default_factory=list)
    max_turns: Annotated[int, _doc("Model turns per episode; the episode ends after the last.", ge=1)] = 4
    turn_max_tokens: Annotated[int, _doc("Most tokens of one model turn; 0: rollout.max_tokens.", ge=0)] = 0
    max_total_tokens: Annotated[
        int, _doc("Most tokens after the first prompt (model and environment) in one episode.", ge=1)
    ] = 1024
    step_timeout_s: Annotated[
        float, _doc("Deadline of one reset/step call; past it the episode is dropped as env_timeout.", gt=0.0)
    ] = 30.0
    episode_timeout_s: Annotated[
        float, _doc("Deadline of a whole episode, generation included (dropped as episode_timeout).", gt=0.0)
    ] = 600.0
    tool_timeout_s: Annotated[float, _doc("Deadline of one tool call; its worker is killed past it.", gt=0.0)] = 10.0
    tool_workers: Annotated[int, _doc("Tool worker processes per rollout node.", ge=1)] = 1
    tool_start_method: Annotated[
        Literal["forkserver", "spawn"],
        _doc("How tool workers start; never fork (the rollout process holds vLLM threads)."),
    ] = "forkserver"


class LossConfig(_Section):
    """The small config the pure loss functions see (learner/losses.py; formulas in docs/ALGORITHMS.md).

    The default correction is bounded, per token: truncated importance sampling, w = pi_prox / mu
    capped at 3, as the asynchronous anchors bound it (verl's fully-async recipes: token level, cap 2;
    AReaL's behav_imp_weight_cap; prime-rl's token mask) with TRL's cap. A per-sequence weight (TRL's
    synchronous default) is a product over the tokens that shrinks with length x staleness: on the
    demo at max_staleness 4 its reward stayed under 0.7 for 30 steps, where per-token truncation
    reached 0.9 by step 23 (docs/ALGORITHMS.md, "The default, and why").
    """

    clip_low: Annotated[float, _doc("Ratio lower clip 1 - clip_low.", ge=0.0, lt=1.0)] = 0.2
    clip_high: Annotated[float, _doc("Ratio upper clip 1 + clip_high (clip-higher when > clip_low).", ge=0.0)] = 0.28
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
    kl_coef: Annotated[float, _doc("KL penalty to a reference policy; 0 disables.", ge=0.0)] = 0.0
    kl_estimator: Annotated[
        Literal["k1", "k2", "k3"],
        _doc(
            "Per-token estimator of KL(pi_theta || ref), r = ref / pi_theta: k1 = -log r, "
            "k2 = (log r)^2 / 2, k3 = r - 1 - log r (unbiased, >= 0, low variance)."
        ),
    ] = "k3"
    entropy_coef: Annotated[
        float, _doc("Entropy bonus: the loss minus entropy_coef x the policy entropy of each loss token.", ge=0.0)
    ] = 0.0
    advantage: Annotated[
        Literal["group_mean", "group_std", "leave_one_out"], _doc("Group-relative advantage estimator.")
    ] = "group_std"

    def __post_init__(self) -> None:
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
    warmup_steps: Annotated[int, _doc("Linear LR warm-up steps.", ge=0)] = 0
    max_grad_norm: Annotated[float, _doc("Gradient clipping norm (on by default; inf disables).", gt=0.0)] = 1.0
    groups_per_step: Annotated[int, _doc("Prompt groups consumed per optimizer step.", ge=1)] = 4
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


class LedgerConfig(_Section):
    url: Annotated[
        str,
        _doc(
            "Redis URL (redis://, rediss:// with TLS, password in the URL). "
            "Empty: an embedded server in the run folder."
        ),
    ] = ""
    max_staleness: Annotated[int, _doc("Oldest policy lag (versions) a trained sample may have.", ge=0)] = 1
    heartbeat_ttl_s: Annotated[float, _doc("A node silent this long is lost.", gt=0.0)] = 15.0
    on_node_lost: Annotated[Literal["drop", "readmit"], _doc("What becomes of a lost node's in-flight samples.")] = (
        "drop"
    )
    connect_retries: Annotated[int, _doc("Connection attempts (with backoff) before failing.", ge=1)] = 5
    retry_s: Annotated[
        float,
        _doc(
            "How long a ledger call keeps retrying (with backoff) while Redis cannot be reached, "
            "e.g. a server restarting from its append-only file; then the role stops with an error "
            "naming the server.",
            gt=0.0,
            le=300.0,
        ),
    ] = 30.0


class TransportConfig(_Section):
    host: Annotated[str, _doc("Address the learner binds; loopback unless given.")] = "127.0.0.1"
    trajectory_port: Annotated[int, _doc("Trajectory PULL port; 0 picks a free one.", ge=0, le=65535)] = 0
    control_port: Annotated[
        int, _doc("Control (register, weights-ready, stop) port; 0 picks a free one.", ge=0, le=65535)
    ] = 0
    hwm: Annotated[int, _doc("Messages queued per socket before a sender blocks (backpressure).", ge=1)] = 1000
    send_timeout_s: Annotated[float, _doc("A send blocked this long fails, naming the peer.", gt=0.0)] = 60.0
    recv_timeout_s: Annotated[float, _doc("A control reply slower than this fails, naming the peer.", gt=0.0)] = 30.0
    max_frame_mb: Annotated[
        float,
        _doc(
            "Largest message a socket accepts, in MiB (ZMQ drops the connection of a peer that sends "
            "a bigger one before reading it); a node refuses to send one. A trajectory of 500k tokens "
            "is about 12 MiB.",
            gt=0.0,
        ),
    ] = 16.0
    fault_log_interval_s: Annotated[
        float,
        _doc(
            "Undecodable frames, duplicates and gaps are counted per sender and logged as one summary "
            "line per sender at most this often.",
            gt=0.0,
        ),
    ] = 60.0


class WeightsConfig(_Section):
    backend: Annotated[Literal["auto", "gloo", "nccl"], _doc("Broadcast backend; auto: nccl on CUDA, else gloo.")] = (
        "auto"
    )
    bucket_mb: Annotated[float, _doc("Flat bucket size in MiB.", gt=0.0)] = 256.0
    timeout_s: Annotated[
        float, _doc("Deadline of each phase (rendezvous, layout, bucket, apply); a node past it is evicted.", gt=0.0)
    ] = 60.0
    store_host: Annotated[
        str,
        _doc(
            "Address of learner rank 0 that nodes reach its weight rendezvous "
            "(TCPStore) at; loopback unless nodes run on other hosts.",
            min_length=1,
        ),
    ] = "127.0.0.1"


class CheckpointConfig(_Section):
    every: Annotated[int, _doc("Save a resumable checkpoint every N steps; 0 disables.", ge=0)] = 0
    keep_last: Annotated[int, _doc("Keep the newest K checkpoints.", ge=1)] = 2
    keep_every: Annotated[int, _doc("Also keep every checkpoint whose step is a multiple of M; 0 disables.", ge=0)] = 0
    export_every: Annotated[int, _doc("Write an HF safetensors export every N steps; 0 disables.", ge=0)] = 0


class TelemetryConfig(_Section):
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], _doc("Log level of rank 0.")] = "INFO"
    tensorboard: Annotated[bool, _doc("Also write TensorBoard events when tensorboard is installed.")] = True
    prometheus_port: Annotated[int, _doc("Serve Prometheus /metrics on this port; 0 disables.", ge=0, le=65535)] = 0
    prometheus_host: Annotated[
        str, _doc("Address the Prometheus endpoint binds; 0.0.0.0 lets a remote Prometheus scrape it.", min_length=1)
    ] = "127.0.0.1"
    wandb: Annotated[bool, _doc("Also log every step to Weights & Biases (needs `pip install wandb`).")] = False
    wandb_project: Annotated[str, _doc("W&B project; the run is named after run.name.", min_length=1)] = "streamrl"
    wandb_mode: Annotated[
        Literal["offline", "online"],
        _doc("offline writes to RUN/wandb with no network (sync later with `wandb sync`); online needs a login."),
    ] = "offline"


class Config(_Section):
    run: RunConfig = msgspec.field(default_factory=RunConfig)
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    env: EnvConfig = msgspec.field(default_factory=EnvConfig)
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    ledger: LedgerConfig = msgspec.field(default_factory=LedgerConfig)
    transport: TransportConfig = msgspec.field(default_factory=TransportConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)


def _parse_value(text: str) -> Any:
    """An override's value as TOML (numbers, bools, lists, quoted strings); else the bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `section.field=value` override to a raw config dict, in place."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} is not of the form section.field=value")
    parts = [p.strip() for p in key.split(".")]
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = _parse_value(value.strip())


def _describe(error: msgspec.ValidationError, data: dict[str, Any]) -> str:
    """Turn msgspec's `... - at `$.learner.lr`` into `learner.lr = VALUE: ...`."""
    message = str(error)
    text, sep, where = message.rpartition(" - at `")
    if not sep:
        text, where = message, "$"
    path = where.rstrip("`").removeprefix("$").lstrip(".")
    value: Any = data
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    unknown = re.match(r"Object contains unknown field `(.+)`", text)
    if unknown:
        section = _struct_at(path)
        allowed = ", ".join(section.__struct_fields__) if section else "?"
        field = f"{(path + '.') if path else ''}{unknown.group(1)}"
        return f"config field `{field}` does not exist; {path or 'top level'} allows: {allowed}"
    shown = f" = {value!r}" if value is not None and not isinstance(value, dict) else ""
    choices = _choices(path)
    return f"config field `{path}`{shown}: {text}" + (f"; allowed: {choices}" if choices else "")


def _struct_at(path: str) -> type | None:
    node: Any = Config
    for part in filter(None, path.split(".")):
        node = typing.get_type_hints(node).get(part) if isinstance(node, type) else None
    return node if isinstance(node, type) and issubclass(node, msgspec.Struct) else None


def _choices(path: str) -> str:
    section, _, field = path.rpartition(".")
    struct = _struct_at(section)
    if struct is None or not field:
        return ""
    hint = typing.get_type_hints(struct, include_extras=True).get(field)
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    return ", ".join(map(repr, typing.get_args(hint))) if typing.get_origin(hint) is Literal else ""


def build(data: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Validate a raw dict (from TOML) plus overrides into a `Config`; raise `ConfigError` naming the field."""
    data = msgspec.convert(data, dict)  # a copy the overrides may change
    for override in overrides:
        apply_override(data, override)
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(_describe(e, data)) from None


def load(path: str | pathlib.Path | None = None, overrides: list[str] = ()) -> Config:
    """Load a TOML file (or the defaults when `path` is None) and apply `--set` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    return build(data, overrides)


def dump(config: Config) -> str:
    """The config as TOML text (for logs and the run folder); `build(tomllib.loads(dump(c))) == c`."""
    import tomli_w

    return tomli_w.dumps(msgspec.to_builtins(config))
