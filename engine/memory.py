"""How much GPU memory each role takes, estimated from the model's config before anything loads.

Used by preflight (ops/preflight.py) to refuse, in seconds, a GPU shared by the learner and a rollout
node (`rollout.share_learner_gpus`) whose two shares cannot fit, and by the nodes to hold themselves
to their share. The formulas are first-order and were checked against measured peaks on an H200:

- learner, per GPU: fp32 master weights, gradients and AdamW (16 bytes a parameter, sharded over the ranks)
  + the bf16 compute copy (2 bytes a parameter, gathered) + activations of one micro-batch of
  `learner.micro_batch_tokens` tokens, 2·(4·hidden + 4·intermediate) bytes per token and layer (one layer's
  with activation checkpointing, plus 2·hidden per layer) + the LM head's logits (kept up to
  `learner.head_logits_gib`, plus an 8192-token fp32 chunk and its gradient) + a reference model (a KL to
  one: shards in model.dtype over the ranks + the copy its pass gathers; none where LoRA's own base is the
  reference) + the critic's value model, trained like the actor but
  after it (weights, gradients and AdamW: its activations are the actor's, freed by then; a LoRA critic: its frozen
  base counted as the LoRA actor's, and its adapters' weights, gradients and AdamW) + 1 GiB of CUDA
  context; on rank 0 two sets of packed weights for the push. The step alone (bench/learner_step.py),
  Qwen2-0.5B body (512-token vocabulary) at 40960 tokens: 49.3 GiB estimated, 46.8 measured; Qwen2.5-3B,
  152k vocabulary, 16384 tokens: 124 estimated, 117 measured.
- hf node: the model and one staging copy of it in the serving dtype + the static KV cache (every
  batch padded to `MAX_BATCH` rows of the prompt width plus `rollout.max_tokens`) + the logits
  `generate` keeps (fp32, one row per token, twice: kept, then stacked; 46 GiB for a 152k vocabulary at
  160 new tokens) + 1 GiB of context and graphs.
- vLLM node: the weights, one staged version, a KV cache for every sequence it may run at its longest, one
  step's activations and logits, and 2 GiB for the context, CUDA graphs and vLLM's workspace (`vllm_node`);
  the node hands vLLM that KV size and that share, so vLLM never sizes itself from what another process
  on the GPU left free. `rollout.gpu_memory_utilization` > 0 lets vLLM size itself instead (that fraction of
  the GPU); `rollout.gpu_memory_gib` sets the share, the KV cache being what the rest leaves.
- Either node in a relay tree (`weights.relay_fanout` > 0) on NCCL: one more copy of what is pushed, which it keeps
  to forward (`relays_on_gpu`).
- One GPU shared by both (`shared_gpu`): async keeps both resident; sync lets a vLLM node sleep while the
  learner trains (KV cache released, weights in host memory: `VLLM_FIXED_GIB` stays), and the learner's
  activations and logits go back to the driver before the node wakes, so the peak is the larger of the two
  phases (learner training beside sleeping nodes; nodes generating beside the learner's resident state).
"""

from __future__ import annotations

import dataclasses

from streamrl.engine.config import Config
from streamrl.engine.config.critic import critic_lora, critic_on
from streamrl.engine.config.rules import longest_sample
from streamrl.engine.lora import reference_is_base
from streamrl.engine.placement import HF_GPU_ROWS, node_groups, shared_groups

GIB = 1 << 30
CONTEXT_GIB = 1.0  # a CUDA context, the allocator's slack, compiled graphs
HEAD_CHUNK = 8192  # tokens of the LM head's fp32 working chunk (learner/logprobs.py)
MAX_BATCH = HF_GPU_ROWS  # the hf backend's rows per batch on CUDA (rollout/backends/hf.py)
WIDTH_STEP = 64  # its prompt widths are padded to a multiple of this
VLLM_BLOCK = 16  # vLLM's KV cache block, tokens
VLLM_BATCH_TOKENS = 16384  # a vLLM node's max_num_batched_tokens on a GPU (vLLM's own default on an H100/H200)
VLLM_FIXED_GIB = 2.0  # CUDA context, the graphs captured for every batch size, vLLM's workspace


@dataclasses.dataclass
class Estimate:
    """A role's memory: named parts in GiB, in the order they are printed."""

    parts: dict[str, float]

    @property
    def gib(self) -> float:
        return sum(self.parts.values())

    def __str__(self) -> str:
        return f"≈ {self.gib:.1f} GiB (" + ", ".join(f"{k} {v:.1f}" for k, v in self.parts.items()) + ")"


@dataclasses.dataclass(frozen=True)
class Shape:
    params: int
    hidden: int
    intermediate: int
    layers: int
    kv_width: int  # key/value heads x head dim
    vocab: int


_counted: dict[str, int] = {}


def _params(hf_config) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    key = hf_config.to_json_string()
    if key not in _counted:
        with torch.device("meta"):  # no memory, no weights read: the architecture's own parameter list
            model = AutoModelForCausalLM.from_config(hf_config)
        _counted[key] = sum(p.numel() for p in model.parameters())
    return _counted[key]


def shape_of(hf_config) -> Shape:
    """The sizes the estimates need, from a transformers config (the parameters counted on the meta device)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    hidden, heads = text.hidden_size, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    return Shape(_params(hf_config), hidden, intermediate, text.num_hidden_layers, kv_heads * head_dim, text.vocab_size)


def learner(cfg: Config, shape: Shape, tokens: int | None = None) -> Estimate:
    """One learner rank's GPU memory at `tokens` per micro-batch (default `learner.micro_batch_tokens`)."""
    lc, p = cfg.learner, shape.params
    tokens = tokens or lc.micro_batch_tokens
    per_layer = 2 * (4 * shape.hidden + 4 * shape.intermediate)  # bytes per token and layer
    if lc.activation_checkpointing:
        activations = tokens * (2 * shape.hidden * shape.layers + per_layer)
    else:
        activations = tokens * per_layer * shape.layers
    kept = min(tokens * shape.vocab * 2, lc.head_logits_gib * GIB)
    nbytes = 4 if cfg.model.dtype == "float32" else 2
    parts = {
        "weights, gradients, AdamW": (16 * p / lc.ranks + 2 * p) / GIB,
        "weight push buffers": 2 * p * nbytes / GIB,  # two packed sets (learner/publisher.py), rank 0
    }
    if cfg.lora.enabled:  # a frozen base in model.dtype; fp32 adapters, their gradients and AdamW; adapter pushes
        a = adapter_params(cfg, shape)
        parts = {
            "frozen base weights (model.dtype)": (p * nbytes / lc.ranks + p * nbytes) / GIB,
            "adapters, gradients, AdamW": (16 * a / lc.ranks + 2 * a) / GIB,
            "adapter push buffers": 2 * a * nbytes / GIB,
        }
    parts |= {
        f"activations of learner.micro_batch_tokens = {tokens}": activations / GIB,
        "LM head": (kept + 2 * min(tokens, HEAD_CHUNK) * shape.vocab * 4) / GIB,
    }
    if (cfg.loss.kl_coef > 0 or cfg.critic.kl_in_reward > 0) and not reference_is_base(cfg):
        parts[reference_label(cfg)] = reference_bytes(cfg, p) / GIB
    if critic_on(cfg.critic.enabled, cfg.loss.advantage) and critic_lora(cfg):  # its own frozen base + adapters
        a = adapter_params(cfg, shape)
        parts["critic: frozen base (model.dtype), adapters, gradients, AdamW"] = (
            p * nbytes / lc.ranks + p * nbytes + 16 * a / lc.ranks + 2 * a
        ) / GIB
    elif critic_on(cfg.critic.enabled, cfg.loss.advantage):  # a full value model (no LM head), after the actor
        parts["critic: weights, gradients, AdamW"] = (16 * p / lc.ranks + 2 * p) / GIB
    parts["CUDA context"] = CONTEXT_GIB
    return Estimate(parts)


def reference_label(cfg: Config) -> str:
    """The split's line for the KL reference: what `reference_bytes` counts, in words."""
    return f"reference model ({cfg.model.dtype} shards / learner.ranks = {cfg.learner.ranks} + its gathered copy)"


def reference_bytes(cfg: Config, params: int) -> int:
    """One learner rank's bytes for a KL reference of its own (learner/reference.py builds it for either KL;
    none where LoRA's own base is the reference, engine/lora.reference_is_base): its shards, stored in the
    compute dtype (it never trains: no fp32 master copy), over the ranks, + the copy its pass gathers, in that
    dtype. The whole model on one rank (nothing reshards there until the pass ends); an upper bound on more,
    where layer units reshard after their forward, as the policy's compute copy is counted whole."""
    nbytes = 4 if cfg.model.dtype == "float32" else 2
    return -(-params // cfg.learner.ranks) * nbytes + params * nbytes


def relays_on_gpu(cfg: Config) -> bool:
    """Whether a node may hold a relay copy on its GPU: one more copy of what is pushed, kept by a node of the relay
    tree (engine/weights/relay.py) on the device it receives on. A tree exists with `weights.relay_fanout`; its
    nodes receive on a broadcast path, NCCL on a GPU (gloo receives, and keeps, in host memory), which `auto` picks
    for nodes off the learner's GPUs (one on them takes its weights by CUDA IPC and never relays)."""
    w = cfg.weights
    return w.relay_fanout > 0 and (w.backend == "nccl" or (w.backend == "auto" and not cfg.rollout.share_learner_gpus))


def _copies(cfg: Config, shape: Shape, nbytes: int) -> dict[str, float]:
    """A node's copies of what is pushed besides its live weights: the staged version, a relay's copy."""
    pushed = (adapter_params(cfg, shape) if cfg.lora.enabled else shape.params) * nbytes / GIB
    relay = {f"relay copy (weights.relay_fanout = {cfg.weights.relay_fanout})": pushed} if relays_on_gpu(cfg) else {}
    return {"staging copy": pushed, **relay}


def hf_node(cfg: Config, shape: Shape) -> Estimate:
    """An hf rollout node's GPU memory (rollout/backends/hf.py on CUDA)."""
    nbytes = 4 if cfg.model.dtype == "float32" else 2
    width = -(-cfg.data.max_prompt_tokens // WIDTH_STEP) * WIDTH_STEP
    positions = MAX_BATCH * (width + cfg.rollout.max_tokens)
    return Estimate(
        {
            "weights": shape.params * nbytes / GIB,
            **_copies(cfg, shape, nbytes),
            f"static cache ({MAX_BATCH} rows x {width + cfg.rollout.max_tokens} tokens)": (
                positions * shape.layers * 2 * shape.kv_width * nbytes / GIB
            ),
            f"logits kept by generate (rollout.max_tokens = {cfg.rollout.max_tokens})": (
                2 * MAX_BATCH * cfg.rollout.max_tokens * shape.vocab * 4 / GIB
            ),
            "CUDA context and graphs": CONTEXT_GIB,
        }
    )


def adapter_params(cfg: Config, shape: Shape) -> int:
    """LoRA parameters on every linear layer of the decoder (rank x (in + out) each; an upper bound when
    lora.target_modules names fewer): q, o h+h; k, v h+kv; gate, up, down h+intermediate."""
    h, kv, i = shape.hidden, shape.kv_width, shape.intermediate
    return cfg.lora.rank * shape.layers * (8 * h + 2 * kv + 3 * i)


def vllm_sequences(cfg: Config) -> int:
    """The sequences a vLLM node on a GPU runs at once (its `max_num_seqs`): every group it may hold."""
    return node_groups(cfg, "cuda") * cfg.rollout.group_size


def vllm_kv_bytes(cfg: Config, shape: Shape) -> int:
    """A KV cache that holds `vllm_sequences` sequences at their longest (whole blocks, plus one block each
    for the block a sequence is growing into), so the engine never preempts one for room."""
    longest, _ = longest_sample(cfg)
    tokens = (-(-(longest + 1) // VLLM_BLOCK) + 1) * VLLM_BLOCK
    nbytes = 4 if cfg.model.dtype == "float32" else 2
    return vllm_sequences(cfg) * tokens * 2 * shape.layers * shape.kv_width * nbytes


def vllm_node(cfg: Config, shape: Shape) -> Estimate:
    """A vLLM node's GPU memory when streamrl sizes it (rollout.gpu_memory_utilization = 0): the weights, one
    staged version, the KV cache of `vllm_kv_bytes`, the activations and sampler of one step of
    `VLLM_BATCH_TOKENS` tokens and `vllm_sequences` rows of logits, and a fixed part for the CUDA context,
    CUDA graphs and vLLM's workspace. The KV cache is what the node passes vLLM as `kv_cache_memory_bytes`."""
    nbytes = 4 if cfg.model.dtype == "float32" else 2
    seqs = vllm_sequences(cfg)
    per_token = 2 * (4 * shape.hidden + 2 * shape.intermediate)  # bytes of a layer's live activations a token
    return Estimate(
        {
            "weights": shape.params * nbytes / GIB,
            **_copies(cfg, shape, nbytes),
            f"KV cache ({seqs} sequences)": vllm_kv_bytes(cfg, shape) / GIB,
            "activations and sampler": (VLLM_BATCH_TOKENS * per_token + 4 * seqs * shape.vocab * 4) / GIB,
            "CUDA context, graphs, vLLM workspace": VLLM_FIXED_GIB,
        }
    )


def node(cfg: Config, shape: Shape, device_gib: float) -> Estimate:
    """What one node takes of a GPU of `device_gib`: `rollout.gpu_memory_gib` when set, else vLLM's own
    reservation (`rollout.gpu_memory_utilization` > 0), else the estimate of its backend."""
    if cfg.rollout.gpu_memory_gib > 0:
        return Estimate({"rollout.gpu_memory_gib": cfg.rollout.gpu_memory_gib})
    if cfg.rollout.backend == "vllm":
        share = cfg.rollout.gpu_memory_utilization
        if share > 0:
            return Estimate({f"rollout.gpu_memory_utilization = {share:g} of the GPU": share * device_gib})
        return vllm_node(cfg, shape)
    return hf_node(cfg, shape)


def largest_tokens(cfg: Config, shape: Shape, room_gib: float) -> int:
    """The largest micro-batch (a multiple of 1024 tokens, at least 1024) whose learner fits `room_gib`; 0: none."""
    best, tokens = 0, 1024
    while tokens <= cfg.learner.micro_batch_tokens and learner(cfg, shape, tokens).gib <= room_gib:
        best, tokens = tokens, tokens + 1024
    return best


def device_gib(gpu: int) -> float:
    """Total memory of this host's GPU `gpu` (its index as this process sees them)."""
    import torch

    return torch.cuda.get_device_properties(gpu).total_memory / GIB


TRANSIENT = ("activations", "LM head")  # the learner's parts freed between steps (sync mode empties the cache)


@dataclasses.dataclass(frozen=True)
class SharedGpu:
    """A GPU shared by a learner rank and `nodes` rollout nodes: what each mode needs of its `total` GiB."""

    learner: Estimate
    node: Estimate
    nodes: int
    total: float
    async_gib: float  # both resident
    sync_gib: float  # sync: a vLLM node asleep while the learner trains (hf nodes do not sleep: = async)

    def fits(self, mode: str) -> bool:
        return (self.sync_gib if mode == "sync" else self.async_gib) <= self.total

    def pick(self, configured: str) -> str:
        """The mode `run.mode` gives here: auto takes async when it fits, else sync when that fits."""
        if configured != "auto":
            return configured
        return "async" if self.fits("async") or not self.fits("sync") else "sync"


def shared_gpu(cfg: Config, shape: Shape, nodes: int, total: float) -> SharedGpu:
    """Both modes' needs; `learner` and `node` are the estimates of the mode run.mode names (auto: async).
    In sync mode a vLLM node holds fewer sequences (one step's groups: placement.admitted_groups), and vLLM nodes
    that share the GPU split them (placement.shared_groups, as the launcher sizes them)."""
    import msgspec

    def in_mode(mode: str) -> Config:  # each node holding its share of the groups (placement.shared_groups)
        moded = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, mode=mode))
        groups = shared_groups(moded, nodes) or cfg.rollout.max_concurrent_groups
        return msgspec.structs.replace(
            moded, rollout=msgspec.structs.replace(cfg.rollout, max_concurrent_groups=groups)
        )

    sync_cfg, async_cfg = in_mode("sync"), in_mode("async")
    learner_est = learner(cfg, shape)
    async_node, sync_node = node(async_cfg, shape, total), node(sync_cfg, shape, total)
    both = learner_est.gib + nodes * async_node.gib
    sync = learner_est.gib + nodes * sync_node.gib
    if cfg.rollout.backend == "vllm":
        resident = sum(v for k, v in learner_est.parts.items() if not k.startswith(TRANSIENT))
        sync = max(learner_est.gib + nodes * VLLM_FIXED_GIB, resident + nodes * sync_node.gib)
    return SharedGpu(learner_est, sync_node if cfg.run.mode == "sync" else async_node, nodes, total, both, sync)
