"""The frozen reference policy of the KL penalty (`loss.kl_coef > 0`), built once at start.

Loaded from `loss.reference_path` (empty: `model.path`, the weights the run starts from; a resumed run
still measures KL to those, not to its checkpoint), sharded over the ranks like the policy
(`parallel.wrap_model`, the same units and compute dtype), in eval mode with no gradient and no
optimizer. It never trains, so it keeps no fp32 master copy: its shards are stored in the compute dtype
(`model.dtype`), which FSDP2 rounded fp32 shards to for every forward anyway, so its logprobs are the ones
an fp32-sharded reference gave, from half the shard bytes in bf16 (engine/memory.reference_bytes counts
them). Its logprobs are of the rollout's sampling distribution (temperature, top-k/top-p), as the
policy's, taken in the no-grad pass before a step's first update (train_step.py). Anything that would
stop it from being built (a path that does not load, another vocabulary) is refused here, at start,
naming the fields: never mid-run.

A LoRA run whose reference is its starting weights (`loss.reference_path` empty) builds no second model:
LoRA never moves the base, so the reference policy is the policy with its adapters off (`BaseReference`;
verl's `ref_in_actor`, TRL's `disable_adapter()`). That saves the base's weights a second time; the forward
per micro-batch it costs is the one a reference of its own took.
"""

from __future__ import annotations

import msgspec
import torch
from torch import Tensor, nn

from streamrl.engine.config import Config, ConfigError
from streamrl.engine.lora import reference_is_base
from streamrl.engine.models import ModelLoadError, default_tiny_model, load_model
from streamrl.learner import lora, parallel
from streamrl.learner.logprobs import PolicyModel

log = parallel.rank0_logger("streamrl.learner")


def reference_source(cfg: Config) -> tuple[str, str]:
    """(the folder or hub id the reference loads from, the config field that named it)."""
    if cfg.loss.reference_path:
        return cfg.loss.reference_path, "loss.reference_path"
    return cfg.model.path or str(default_tiny_model()), "model.path"


class BaseReference:
    """The reference policy of a LoRA run whose reference is its starting weights: `policy`, adapters off.

    Called as a reference model is, (micro-batch inputs) -> (logprobs, entropy), in no-grad passes only; its
    distribution is the policy's sampling one (the policy's temperature, top-k/top-p, which are the rollout's).
    Nothing of the policy changes: its adapters stay trainable and in the optimizer, and the push reads them."""

    def __init__(self, policy: PolicyModel):
        self.policy, self._off = policy, lora.AdaptersOff(policy)

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        if torch.is_grad_enabled():
            # with a gradient its graph would run through the policy's own parameters
            raise RuntimeError("BaseReference runs in no-grad passes only (its forward is the policy's)")
        with self._off:
            return self.policy(*inputs)


def build_reference(
    cfg: Config, device: torch.device, compute_dtype: torch.dtype, policy: PolicyModel
) -> PolicyModel | BaseReference | None:
    """The reference policy for `loss.kl_coef > 0` or `critic.kl_in_reward > 0` (None when both are 0): with
    LoRA and no `loss.reference_path`, the policy's own base (`BaseReference`), else a model of its own;
    ConfigError when it cannot be built."""
    if cfg.loss.kl_coef == 0 and cfg.critic.kl_in_reward == 0:
        return None
    if reference_is_base(cfg):
        log.info("reference policy: the policy's frozen base with its LoRA adapters off (no second model)")
        return BaseReference(policy)
    path, field = reference_source(cfg)
    kl = cfg.loss.kl_coef or cfg.critic.kl_in_reward
    knob = "loss.kl_coef" if cfg.loss.kl_coef else "critic.kl_in_reward"
    why = f"{knob} = {kl} needs a reference model, but {field} = {path!r}"
    fix = f"set loss.reference_path to a model folder with the policy's vocabulary, or {knob} = 0"
    try:
        # the compute dtype (as LoRA's frozen base): FSDP2 rounded fp32 shards to it for every forward anyway
        lm = load_model(path, str(compute_dtype).removeprefix("torch."), "cpu", cfg.model.trust_remote_code)
    except (ModelLoadError, OSError, ValueError) as e:
        raise ConfigError(f"{why} does not load ({e}); {fix}") from None
    vocab, policy_vocab = lm.get_output_embeddings().weight.shape[0], policy.lm.get_output_embeddings().weight.shape[0]
    if vocab != policy_vocab:
        raise ConfigError(f"{why} has a vocabulary of {vocab} tokens, the policy {policy_vocab}; {fix}")
    # activation checkpointing saves nothing without a backward
    learner = msgspec.structs.replace(cfg.learner, activation_checkpointing=False)
    sampling = dict(temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p)
    lm.requires_grad_(False)  # frozen before wrap_model, which then keeps the dtype it was loaded in
    ref = parallel.wrap_model(lm, learner, device, compute_dtype=compute_dtype, **sampling)
    return ref.eval()


def release(model: nn.Module | BaseReference) -> None:
    """Free a no-grad model's gathered parameters after its pass (its root unit keeps them otherwise:
    wrap_model does not reshard the root after forward, which backward would need at once). A
    `BaseReference`'s are the policy's, which its next forward needs: kept."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.reshard()
