"""The critic's half of a learner step: its values, the step's per-token advantages, and its own updates.

`Shaper.advantages` runs before the actor's updates: a no-grad forward of the value model over every
micro-batch (the critic as it is now: a stale sample's values are the current critic's, not those of the
version that sampled it; docs/ALGORITHMS.md says why), then GAE and whitening (token_advantages.py), with
the whitening's moments reduced over ranks here, once. `Shaper.train` then takes the critic's updates on the
same mini-batches as the actor (one per mini-batch per epoch), with the policy loss's token weights and
global normalisers, so micro-batching and ranks do not change the value loss either. For REINFORCE++ there
is no value model: `advantages` makes the whitened returns and `train` only reports.

With critic.kl_in_reward, `advantages` also takes the KL to the reference out of the rewards, with the beta
of the step's `KLController` (kl_control.py: fixed, or adaptive), and moves it once the step's KL is known.

The critic's optimizer, schedule and step count are its own (critic.lr, max_grad_norm, weight_decay); for
`critic.warmup_steps` steps the actor waits (`actor_waits`). An update whose gradient norm is not finite is
skipped on the device (the fused AdamW's found_inf, as the actor's) and counted.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from streamrl.engine.config import LossConfig
from streamrl.engine.config.critic import CriticConfig
from streamrl.engine.messages import AdapterSpec
from streamrl.learner import parallel
from streamrl.learner.batching import MicroBatch
from streamrl.learner.critic import value_loss as VL
from streamrl.learner.critic.kl_control import KLController, sequence_kl
from streamrl.learner.critic.model import ValueModel
from streamrl.learner.critic.token_advantages import token_advantages
from streamrl.learner.losses import token_weights


class Shaper:
    """Per-token advantages for the actor; with a value model, the critic's optimizer and updates."""

    def __init__(
        self,
        model: ValueModel | None,
        cfg: CriticConfig,
        loss_cfg: LossConfig,
        device: torch.device,
        reference: nn.Module | None = None,
        adapter: AdapterSpec | None = None,
        base: str = "",
    ) -> None:
        """reference: the frozen reference policy of critic.kl_in_reward (None when it is 0); adapter, base: a
        LoRA critic's adapter (critic.lora: model.adapt) and the folder of its frozen base, for its checkpoints
        and export."""
        self.model, self.cfg, self.loss_cfg, self.device = model, cfg, loss_cfg, device
        self.reference, self.adapter, self.base = reference, adapter, base
        self.kl_ctrl = KLController(cfg.kl_in_reward, cfg.kl_ctrl == "adaptive", cfg.kl_target, cfg.kl_horizon)
        self.optimizer = None
        if model is not None:
            params = [p for p in model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)
        self.steps = 0  # steps the critic has trained (kept in checkpoints): the actor waits while < warmup
        self.skipped_updates = 0  # critic updates skipped for a non-finite gradient, since this process started
        self._targets: list[list[tuple[Tensor, Tensor]]] = []  # per mini-batch, per micro-batch: (old values, returns)
        self._sums: dict[str, Tensor | float] = {}
        self._kl_metrics: dict[str, float] = {}  # the step's KL in the reward and its beta (reduced already)

    def actor_waits(self) -> bool:
        """True during critic.warmup_steps: the critic trains alone."""
        return self.model is not None and self.steps < self.cfg.warmup_steps

    def state_dict(self) -> dict[str, int | float | None]:
        return {"critic_steps": self.steps, **self.kl_ctrl.state_dict()}

    def load_state_dict(self, state: dict[str, int | float | None]) -> None:
        self.steps = int(state.get("critic_steps", 0))
        self.kl_ctrl.load_state_dict(state)

    @torch.no_grad()
    def values(self, mb: MicroBatch) -> Tensor:
        return self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)

    def advantages(self, minis: list[list[MicroBatch]]) -> list[list[MicroBatch]]:
        """The mini-batches with per-token advantages (the values and returns kept for `train`)."""
        flat = [mb for mini in minis for mb in mini]
        values = None
        if self.model is not None:
            values = [self.values(mb) for mb in flat]
            _release(self.model)
        kl, beta = self._kl(flat), self.kl_ctrl.value
        shaped, returns = token_advantages(flat, values, self.loss_cfg.advantage, self.cfg, self._reduce, kl, beta)
        self._kl_metrics = self._kl_figures(flat, kl, beta) if kl else {}
        old = values or returns
        self._sums = {}
        if self.model is not None:
            for mb, v, r in zip(shaped, old, returns):
                for prefix, mask in (("", mb.loss_mask), ("last/", _turn_ends(mb))):
                    for key, value in VL.value_stats(v, r, mask).items():
                        self._sums[prefix + key] = _combine(prefix + key, self._sums.get(prefix + key), value)
        out, at, self._targets = [], 0, []
        for mini in minis:
            out.append(shaped[at : at + len(mini)])
            self._targets.append(list(zip(old[at : at + len(mini)], returns[at : at + len(mini)])))
            at += len(mini)
        return out

    @torch.no_grad()
    def _kl(self, micro_batches: list[MicroBatch]) -> list[Tensor] | None:
        """Per-token log mu - log pi_ref of every micro-batch (the k1 estimate of KL(mu || ref) at the sampled
        token, verl's default `kl_penalty`), for critic.kl_in_reward; None when it is off."""
        if self.reference is None or not self.cfg.kl_in_reward:
            return None
        out = [
            torch.where(mb.loss_mask, mb.behavior_logprobs - self.reference(*_inputs(mb))[0], 0.0)
            for mb in micro_batches
        ]
        _release(self.reference)
        return out

    def _kl_figures(self, mbs: list[MicroBatch], kl: list[Tensor], beta: float) -> dict[str, float]:
        """The step's KL in the reward (mean over its completions, all ranks) and the beta its rewards took;
        then the controller's update (the same on every rank: it reads the reduced sums)."""
        parts = [sequence_kl(k, mb.loss_mask, mb.seq_ids, mb.cu_seqlens.numel() - 1) for k, mb in zip(kl, mbs)]
        total, sequences = (float(v) for v in self._reduce(torch.stack(parts).sum(0)))
        current = total / sequences if sequences else 0.0
        if sequences:
            self.kl_ctrl.update(current, int(sequences))
        return {"critic/reward_kl": current, "critic/reward_kl_coef": beta}

    def _reduce(self, moments: Tensor) -> Tensor:
        if parallel.world_size() == 1:
            return moments
        out = moments.to(self.device, torch.float64)
        torch.distributed.all_reduce(out)
        return out

    def train(self, minis: list[list[MicroBatch]], normalizers: list[float], epochs: int) -> dict[str, float]:
        """The critic's updates (one per mini-batch per epoch: critic.epochs, else the actor's `epochs`) and the
        step's critic metrics (reduced)."""
        if self.model is None:
            return dict(self._kl_metrics)
        norms = [
            self._update(mini, targets, n)
            for _ in range(self.cfg.epochs or epochs)
            for mini, targets, n in zip(minis, self._targets, normalizers)
        ]
        self.steps += 1
        local = {k: float(v) for k, v in self._sums.items()}
        reduced = parallel.reduce_metrics(local, self.device)
        metrics = {f"critic/{k}": v for k, v in VL.summarize(reduced).items()}
        last = VL.summarize({k.removeprefix("last/"): v for k, v in reduced.items() if k.startswith("last/")})
        if "vf_explained_var" in last:  # the critic where the completion is known but its last token
            metrics["critic/vf_explained_var_last"] = last["vf_explained_var"]
        finite = [n for n in norms if n == n and n != float("inf")]
        metrics["critic/grad_norm"] = max(finite) if finite else float("nan")
        metrics["critic/lr"] = self.cfg.lr
        metrics["critic/skipped_updates"] = float(self.skipped_updates)
        return {**metrics, **self._kl_metrics}

    def _update(self, mini: list[MicroBatch], targets: list[tuple[Tensor, Tensor]], normalizer: float) -> float:
        for i, (mb, (old, returns)) in enumerate(zip(mini, targets)):
            parallel.set_grad_sync(self.model, i == len(mini) - 1)
            values = self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
            weights = token_weights(mb.loss_mask, mb.seq_ids, self.loss_cfg)
            loss, stats = VL.value_loss(
                values, old, returns, mb.loss_mask, weights, normalizer, clip=self.cfg.value_clip
            )
            loss.backward()
            for key, value in stats.items():
                self._sums[key] = _combine(key, self._sums.get(key), value.detach())
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        finite = torch.isfinite(norm)
        torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, torch.where(finite, norm, 0.0))
        self.optimizer.found_inf = (~finite).float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        value = float(norm)
        self.skipped_updates += not (value == value and value != float("inf"))
        return value


def _combine(key: str, old, new):
    if old is None:
        return new
    if key.endswith("_max"):
        return torch.maximum(torch.as_tensor(old), torch.as_tensor(new))
    if key.endswith("_min"):
        return torch.minimum(torch.as_tensor(old), torch.as_tensor(new))
    return old + new


def _inputs(mb: MicroBatch) -> tuple:
    return mb.input_ids, mb.position_ids, mb.targets, mb.cu_seqlens, mb.max_seqlen


def _turn_ends(mb: MicroBatch) -> Tensor:
    """[T] bool: the last loss token of each sequence (of each model turn, in a multi-turn episode)."""
    mask = mb.loss_mask.to(torch.bool)
    follows = torch.zeros_like(mask)
    follows[:-1] = mask[1:] & (mb.seq_ids[1:] == mb.seq_ids[:-1])
    return mask & ~follows


def _release(model) -> None:
    from streamrl.learner.reference import release

    release(model)


def build_shaper(cfg, device: torch.device, compute_dtype: torch.dtype, reference=None) -> Shaper | None:
    """The step's per-token advantages for loss.advantage gae / reinforce_pp(_baseline), with the critic where
    it is on (critic.path, else model.path); None for the group estimators. ConfigError if it cannot load.
    reference: the frozen reference policy (learner/reference.py), for critic.kl_in_reward."""
    from streamrl.engine.config import ConfigError
    from streamrl.engine.config.critic import critic_lora, critic_on
    from streamrl.engine.models import default_tiny_model
    from streamrl.learner.critic.model import adapt, load_value_net, wrap_value_model
    from streamrl.learner.critic.token_advantages import PER_TOKEN

    if cfg.loss.advantage not in PER_TOKEN:
        return None
    model, adapter, path = None, None, ""
    if critic_on(cfg.critic.enabled, cfg.loss.advantage):
        actor_path = cfg.model.path or str(default_tiny_model())
        path = cfg.critic.path or actor_path
        net = load_value_net(path, cfg.model.trust_remote_code)
        actor_vocab = _vocab(actor_path)
        if actor_vocab and net.get_input_embeddings().weight.shape[0] < actor_vocab:
            raise ConfigError(
                f"critic.path = {cfg.critic.path!r} embeds {net.get_input_embeddings().weight.shape[0]} tokens, "
                f"fewer than the actor's {actor_vocab}: the critic reads the actor's token ids; give a model "
                "with the actor's tokenizer"
            )
        if critic_lora(cfg):  # adapters and head on a frozen base in the compute dtype (model.adapt)
            net, adapter = adapt(net, cfg.lora, compute_dtype)
        model = wrap_value_model(net, cfg.learner, device, compute_dtype)
    reference = reference if cfg.critic.kl_in_reward else None
    return Shaper(model, cfg.critic, cfg.loss, device, reference, adapter=adapter, base=path if adapter else "")


def _vocab(path: str) -> int:
    from transformers import AutoConfig

    try:
        return int(AutoConfig.from_pretrained(path).vocab_size)
    except (OSError, ValueError, AttributeError):
        return 0
