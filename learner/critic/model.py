"""The value model: the actor's architecture with a scalar head, one value per position of a packed micro-batch.

It is a HF sequence-classification model with one label (`Qwen2ForSequenceClassification`: the decoder body
and `score`, a [1, hidden] linear without bias), the form reward models are saved in, so `critic.path` may be
a reward model's folder (body and head load: "the reward model's output is the critic's target"), a causal
LM folder (the body loads, the head starts at 0, so every first value is 0), or empty: the actor's
starting weights. Unlike `...ForSequenceClassification.forward`, which scores one position per sequence,
`ValueModel` applies the head at every position: values[t] = V(prefix up to t), the value of the state in
which targets[t] is sampled. Sharded over the learner ranks by `parallel.shard` like the actor (fp32
master weights, compute in model.dtype, varlen attention on CUDA); `streamrl export --critic` writes it
back as the same kind of HF folder. A LoRA critic (`adapt`, critic.lora) trains adapters and the head on a frozen
copy of that body: the body's weights are then not the actor's, a second base (verl's and OpenRLHF's LoRA critic).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streamrl.engine.config import ConfigError, LearnerConfig, LoraConfig
from streamrl.engine.messages import AdapterSpec
from streamrl.engine.models import ModelLoadError, check_model_folder
from streamrl.learner import attention, parallel


class ValueModel(nn.Module):
    """A sequence-classification model (one label) whose forward maps a packed micro-batch to values [T] fp32."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    @property
    def body(self) -> nn.Module:
        return getattr(self.net, self.net.base_model_prefix)

    def forward(self, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        extra = {}
        if self.net.config._attn_implementation == "streamrl_varlen":
            cu = cu_seqlens.to(torch.int32)
            extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_seqlen, max_length_k=max_seqlen)
        out = self.body(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **extra)
        # a copy, not a view: FSDP2 warns of a view returned from a wrapped module (T floats, nothing to save)
        return self.net.score(out.last_hidden_state[0]).squeeze(-1).to(torch.float32, copy=True)


def load_value_net(path: str, trust_remote_code: bool = False) -> nn.Module:
    """The HF one-label sequence-classification model of `path` in fp32 on the CPU; a head the folder lacks
    (a causal LM's) starts at 0. ConfigError naming critic.path when it does not load."""
    from transformers import AutoModelForSequenceClassification

    try:
        check_model_folder(path, trust_remote_code)
        net, info = AutoModelForSequenceClassification.from_pretrained(
            str(path),
            num_labels=1,
            dtype=torch.float32,
            trust_remote_code=trust_remote_code,
            attn_implementation="sdpa",
            output_loading_info=True,
        )
    except (ModelLoadError, OSError, ValueError) as e:
        raise ConfigError(
            f"the critic's model {path!r} (critic.path, else model.path) does not load as a value model ({e}); "
            "give a causal LM or a one-label reward model folder"
        ) from None
    if net.score.weight.shape[0] != 1:
        raise ConfigError(f"critic.path = {path!r} has a head of {net.score.weight.shape[0]} labels; a value needs 1")
    if any(key.startswith("score.") for key in info["missing_keys"]):
        with torch.no_grad():
            net.score.weight.zero_()  # a new head: values start at 0 rather than at a random projection
    return net


def adapt(net: nn.Module, cfg: LoraConfig, base_dtype: torch.dtype) -> tuple[nn.Module, AdapterSpec]:
    """A LoRA critic (critic.lora): PEFT's adapters on the body's linears (the [lora] section's rank, alpha and
    targets; the head is never a target) and the head trainable in fp32, the rest frozen in `base_dtype`. At the
    start its values are the full critic's (B starts at 0)."""
    from streamrl.learner import lora

    net, spec = lora.apply(net, cfg, base_dtype, task_type=None)
    for param in net.score.parameters():
        param.data = param.data.float()
        param.requires_grad_(True)
    return net, spec


def wrap_value_model(
    net: nn.Module, cfg: LearnerConfig, device: torch.device, compute_dtype: torch.dtype | None = None
) -> ValueModel:
    """The value model sharded like the actor (`parallel.shard`), in train mode; a LoRA critic's (`adapt`) frozen
    base stays in its dtype, everything else is fp32 master weights."""
    parallel.init_distributed()
    if device.type == "cuda" and attention.register_varlen_attention():
        net.config._attn_implementation = "streamrl_varlen"
    frozen = any(not p.requires_grad for p in net.parameters())
    net = (net.to(device=device) if frozen else net.to(device=device, dtype=torch.float32)).train()
    return parallel.shard(ValueModel(net), getattr(net, net.base_model_prefix).layers, cfg, device, compute_dtype)
