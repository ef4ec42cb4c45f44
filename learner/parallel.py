"""Everything that knows about ranks: the process group, FSDP2 wrapping, reductions, rank-0 logging.

The training step calls into this file and never asks how many ranks there are. One process
without torchrun still gets a (one-rank) process group, so FSDP2 runs the same code path at any
world size. Gradients are *summed* across ranks (divide factor 1): the loss is already divided by
the global normaliser, so the sum is the gradient of the whole batch however it was split.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from streamrl.engine.config import LearnerConfig
from streamrl.learner import attention
from streamrl.learner.logprobs import PolicyModel

DEFAULT_TIMEOUT_S = 300.0


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join torchrun's group (env RANK/WORLD_SIZE/...) or make a one-rank group; return this rank's device.

    nccl on CUDA, gloo on CPU; every collective fails after `timeout_s` instead of hanging.
    """
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device if cuda else None)
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device if cuda else None
        )
    return device


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def rank0_logger(name: str) -> logging.Logger:
    """The logger `name` on rank 0; a silent one on every other rank."""
    logger = logging.getLogger(name if is_rank0() else f"{name}.rank{rank()}")
    if not is_rank0():
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
        logger.disabled = True
    return logger


def layer_units(sizes: list[int], unit_params: int) -> list[list[int]]:
    """Consecutive layer indices grouped into FSDP units of at least `unit_params` parameters
    (a remainder joins the last unit); [] when one unit would hold every layer: the root then holds them."""
    units: list[list[int]] = [[]]
    held = 0
    for i, size in enumerate(sizes):
        units[-1].append(i)
        held += size
        if held >= unit_params:
            units.append([])
            held = 0
    if not units[-1]:
        units.pop()
    elif len(units) > 1:
        tail = units.pop()
        units[-1] += tail
    return units if len(units) > 1 else []


def wrap_model(
    model: nn.Module,
    cfg: LearnerConfig,
    device: torch.device,
    *,
    temperature: float = 1.0,
    chunk: int = 0,
    compute_dtype: torch.dtype | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> PolicyModel:
    """A HF causal LM as the policy (`PolicyModel`), sharded over all ranks by `shard`; on CUDA, varlen
    attention for packed sequences. temperature, top_k, top_p: the rollout engines' sampling, whose
    distribution the policy's logprobs are of (engine/sampling.py); compute_dtype: the learner passes
    `model.dtype`."""
    init_distributed()
    if device.type == "cuda" and attention.register_varlen_attention():
        model.config._attn_implementation = "streamrl_varlen"
    # a frozen model keeps the dtype it was loaded in: LoRA's base (lora.py), the KL reference (reference.py)
    frozen = any(not p.requires_grad for p in model.parameters())
    model = (model.to(device) if frozen else model.to(device=device, dtype=torch.float32)).train()
    policy = PolicyModel(
        model,
        chunk=chunk,
        temperature=temperature,
        keep_logits_bytes=int(cfg.head_logits_gib * 2**30),
        top_k=top_k,
        top_p=top_p,
    )
    return shard(policy, model.model.layers, cfg, device, compute_dtype)


def shard(root: nn.Module, layers: nn.ModuleList, cfg: LearnerConfig, device: torch.device, compute_dtype=None):
    """FSDP2 over all ranks: the decoder `layers` in units of `cfg.fsdp_unit_params` parameters, the rest (or,
    for a model under one unit, everything) at `root` (the policy, or the critic's value model). Optional
    activation checkpointing; per-layer torch.compile when `cfg.compile` is true, or "auto" on CUDA.

    Master weights and gradient reductions in fp32, gradients summed across ranks; compute in `compute_dtype`
    (default: bf16 on CUDA, fp32 elsewhere). Fewer, larger units mean fewer hooks and collectives per
    micro-batch: a 0.5B model on H200s stepped at 34.4% MFU as one unit vs 32.8% as 24 layer units (1 GPU),
    35.0% vs 25.3% per GPU (2 GPUs); layer units pay off when the gathered model would not fit
    (bench/RESULTS.md)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if cfg.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    if compiles(cfg, device):
        for layer in layers:
            layer.compile()  # static shapes first; torch marks T dynamic if it varies

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mp = (
        MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if compute_dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    reshard = dist.get_world_size() > 1  # one rank: nothing to save by freeing the gathered weights
    for unit in layer_units([sum(p.numel() for p in layer.parameters()) for layer in layers], cfg.fsdp_unit_params):
        fully_shard([layers[i] for i in unit], mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=False)  # backward needs it at once
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return root


def compiles(cfg: LearnerConfig, device: torch.device) -> bool:
    """Whether the learner compiles its decoder layers: `learner.compile`, where "auto" is on CUDA only."""
    return cfg.compile is True or (cfg.compile == "auto" and device.type == "cuda")


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduces gradients across ranks; off for all but a step's last micro-batch
    (gradients then accumulate unsharded, in fp32, and are reduced once). Off, the root unit also stays
    gathered after backward, so the next micro-batch does not gather it again."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        model.set_reshard_after_backward(enabled, recurse=False)


def gather_for_next_forward(model: nn.Module) -> None:
    """Gather the root unit's parameters now, right after an optimizer step, instead of in the next forward.

    Everything here is queued on CUDA streams, so the host does the gather's per-parameter work (about
    11 ms for a 0.5B model's 290 parameters) while the GPU still runs this step, not while it idles at
    the start of the next one. A state dict taken in between is still the sharded fp32 one: FSDP2's
    state-dict hook reshards first.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.unshard()


def hf_name(name: str) -> str:
    """A parameter's HF checkpoint name, without the wrappers' prefixes (activation checkpointing, compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class PushWeights:
    """The full weights for a push to the engines: every rank calls; rank 0 gets them under HF names in
    `dtype`, on the device, the others an empty dict. No host copy, no resharding.

    After `gather_for_next_forward` the parameters are the gathered copies the next forward reads
    (in the compute dtype), so the step's one gather serves the push too; a parameter still sharded
    (a layer unit resharded after backward) is gathered here. Tied parameters keep one tensor.
    The module tree is walked once, here: each call reads the parameter slots directly (FSDP2 swaps
    its gathered and sharded tensors in those slots), so the push's hold pays no walk over every
    module (~0.7 ms of host time for a 0.5B model's 291 names, measured on CPU).
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, adapters: bool = False):
        """adapters: LoRA, only the adapter tensors, under PEFT's saved names (engine/lora.py)."""
        from streamrl.engine import lora

        lm = model.lm if isinstance(model, PolicyModel) else model
        self.dtype = dtype
        self._slots = [  # (HF name, the module's parameter dict, the key in it), in named_parameters order
            (hf_name(f"{prefix}.{key}" if prefix else key), module._parameters, key)
            for prefix, module in lm.named_modules(remove_duplicate=False)
            for key, param in module._parameters.items()
            if param is not None
        ]
        if adapters:
            self._slots = [(lora.wire_name(n), p, k) for n, p, k in self._slots if lora.is_adapter(n)]

    def __call__(self) -> dict[str, Tensor]:
        from torch.distributed.tensor import DTensor

        rank0, out, seen = is_rank0(), {}, {}
        for name, params, key in self._slots:
            param = params[key]
            full = seen.get(id(param))
            if full is None:
                full = self._whole(param) if isinstance(param, DTensor) else param
                seen[id(param)] = full = full if full.dtype == self.dtype else full.to(self.dtype)
            if rank0:
                out[name] = full
        return out

    @staticmethod
    def _whole(param) -> Tensor:
        """A sharded parameter's full tensor: gathered over the ranks; on one rank its local tensor (the
        optimizer updates it in place). DTensor's own calls cost ~0.1-0.2 ms of host time each: a 0.5B model's
        336 LoRA tensors took 92 ms a push with full_tensor, 46 with to_local, 0.6 reading the local tensor
        (CPU; the 7B LoRA loop's push held the learner 58 ms on an H200, bench/RESULTS.md)."""
        if param.device_mesh.size() > 1:
            return param.full_tensor()
        return param._local_tensor  # to_local() without its autograd wrapper: the same tensor


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Every rank calls; rank 0 gets full CPU tensors under HF names, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lm = model.lm if isinstance(model, PolicyModel) else model
    state = get_model_state_dict(lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {hf_name(k): v for k, v in state.items()} if is_rank0() else {}


def max_over_ranks(value: int, device: torch.device) -> int:
    return int(_reduce_scalar(value, dist.ReduceOp.MAX, torch.int64, device))


def sum_over_ranks(value: float, device: torch.device) -> float:
    return float(_reduce_scalar(value, dist.ReduceOp.SUM, torch.float64, device))


def _reduce_scalar(value: int | float, op, dtype: torch.dtype, device: torch.device) -> int | float:
    if world_size() == 1:
        return value  # one rank: no device round trip (each is a host sync)
    out = torch.tensor([value], dtype=dtype, device=device)
    dist.all_reduce(out, op=op)
    return out.item()


def reduce_metrics(metrics: dict[str, float | Tensor], device: torch.device | None = None) -> dict[str, float]:
    """Reduce a metrics dict over ranks: keys ending `_max` by max, `_min` by min, the rest summed.

    Every rank must pass the same keys. Means are formed afterwards from reduced sums (see
    losses.summarize), so no rank's share is weighted wrongly.
    """
    keys = sorted(metrics)
    if world_size() == 1:
        return {k: float(metrics[k]) for k in keys}
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device or torch.device("cpu"))
    for suffix, op in (("_max", dist.ReduceOp.MAX), ("_min", dist.ReduceOp.MIN), ("", dist.ReduceOp.SUM)):
        idx = [i for i, k in enumerate(keys) if k.endswith(suffix) and (suffix or not k.endswith(("_max", "_min")))]
        if idx:
            part = values[idx].clone()
            dist.all_reduce(part, op=op)
            values[idx] = part
    return dict(zip(keys, values.tolist()))


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def gather_objects(obj) -> list:
    """Every rank's `obj` (small, picklable: names, errors), in rank order; on every rank."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(value):
    """Rank 0's `value` (small, picklable), on every rank."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_names(names: list[str]) -> list[str]:
    """Union of a list of names from every rank (used on the rare non-finite step)."""
    if world_size() == 1:
        return sorted(set(names))
    everyone: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    return sorted({n for part in everyone for n in (part or [])})


def shutdown(timeout_s: float = 60.0) -> None:
    """Clean teardown: wait for every rank (bounded), then destroy the group.

    Without the barrier a rank that exits first tears its gloo pairs down under a peer that is
    still sending, which aborted the process ("terminate called without an active exception").
    """
    if not dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if dist.get_world_size() > 1:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.barrier()
    dist.destroy_process_group()
