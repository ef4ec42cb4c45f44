"""Config sections of the rollout side: prompts, generation, rewards, environments, simulated generation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from streamrl.engine.config.base import _doc, _Section


class DataConfig(_Section):
    path: Annotated[
        str,
        _doc(
            "Prompt file (.jsonl, .parquet), a saved HF dataset folder, reasoning_gym:NAME[:SIZE[:SEED]] or "
            "verifiers:TASKSET_ID (README: Bring your environment). Empty: the built-in demo task."
        ),
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
        Literal["vllm", "hf", "auto"],
        _doc(
            "Generation engine: vllm, hf (transformers generate), or auto: vllm where it is installed on the "
            "host that reads the config, else hf (resolved when the config is built)."
        ),
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
    max_concurrent_groups: Annotated[
        int,
        _doc(
            "Groups one node generates at once (bounded by credits too); 0: the engine's choice "
            "(engine/placement.node_groups: 8 on CPU; on a GPU, every group the credits admit for vLLM, "
            "256 rows for hf's static cache).",
            ge=0,
        ),
    ] = 0
    kv_at_swap: Annotated[
        Literal["recompute", "keep"],
        _doc(
            "vLLM: what becomes of the KV of requests running when a new version goes live. recompute: they "
            "are preempted and re-prefilled, so every later token comes from the new weights alone; keep: they "
            "go on over the KV they have (PipelineRL's in-flight update: no stall), their tokens stamped with "
            "the version they started under; new requests never reuse an older version's cached prefix."
        ),
    ] = "keep"
    kv_cache_gib: Annotated[
        float, _doc("KV cache size per vLLM engine in GiB (explicit: the CPU default reserves ~9 GiB).", gt=0.0)
    ] = 0.25
    gpu_memory_utilization: Annotated[
        float,
        _doc(
            "vLLM's GPU memory share as a fraction of the GPU, vLLM sizing its KV cache from what is free then "
            "(CUDA only); 0: streamrl sizes it (engine/memory.vllm_node: a KV cache for every sequence the "
            "node may run, at its longest).",
            ge=0.0,
            le=1.0,
        ),
    ] = 0.0
    gpu_memory_gib: Annotated[
        float,
        _doc(
            "GPU memory one node may take (weights, staging copy, KV or static cache), GiB; 0: estimated from "
            "the model and these settings (hf) or gpu_memory_utilization (vLLM). On a GPU shared with the "
            "learner, preflight checks both shares fit; the hf node is held to it, vLLM gets it as its share.",
            ge=0.0,
        ),
    ] = 0.0
    enforce_eager: Annotated[
        bool | Literal["auto"],
        _doc(
            "Skip vLLM's CUDA graphs and compilation (fast start, slow decode); auto: eager on CPU, graphs "
            "and compilation on a GPU (a small model's eager decode is bound by kernel launches)."
        ),
    ] = "auto"
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


class SimulateConfig(_Section):
    """Timed sleeps in place of generation and/or training, to measure the scheduler itself (`streamrl
    bench pipeline --simulate`). Seconds per step; each group of a step takes its share, one at a time."""

    gen_s: Annotated[float, _doc("Generation seconds per step (0: real generation).", ge=0.0)] = 0.0
    gen_sd: Annotated[float, _doc("Standard deviation of gen_s (normal, clipped at 0).", ge=0.0)] = 0.0
    train_s: Annotated[float, _doc("Training seconds per step (0: real training).", ge=0.0)] = 0.0
    train_sd: Annotated[float, _doc("Standard deviation of train_s (normal, clipped at 0).", ge=0.0)] = 0.0
