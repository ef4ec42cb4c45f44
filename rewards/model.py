"""Reward-model scoring: a local HF sequence classifier or causal LM, batched on the caller's device.

The raw score is one logit: output `index` of a sequence classifier, or the logit of one token at
the last position of a causal LM (a "Yes"-token judge). It is mapped by explicit config,
score = clip(transform(raw * scale + shift), clip_low, clip_high), because a reward model's raw
scale (often around -10 or +20) silently breaks PPO when fed through unchanged. At start a few
probe samples are scored and a warning names the problem when the scores are constant or land
far outside [clip_low, clip_high].
"""

from __future__ import annotations

import logging

import torch

from streamrl.engine.config import RewardModelConfig

log = logging.getLogger("streamrl.rewards")

PROBES = [
    ("What is 2 + 2?", "4"),
    ("What is 2 + 2?", "The answer is five, obviously, because I said so."),
    ("Name a colour.", "blue"),
    ("Name a colour.", "cat dog moon star one two three"),
    ("Say yes.", "yes"),
    ("Say yes.", ""),
]

_TRANSFORMS = {"none": lambda x: x, "sigmoid": torch.sigmoid, "tanh": torch.tanh}


def map_scores(raw: torch.Tensor, cfg: RewardModelConfig) -> torch.Tensor:
    """clip(transform(raw * scale + shift), clip_low, clip_high), elementwise."""
    return unclipped(raw, cfg).clamp(cfg.clip_low, cfg.clip_high)


def unclipped(raw: torch.Tensor, cfg: RewardModelConfig) -> torch.Tensor:
    return _TRANSFORMS[cfg.transform](raw.double() * cfg.scale + cfg.shift)


def range_warnings(raw: torch.Tensor, cfg: RewardModelConfig) -> list[str]:
    """Why these probe scores look wrong (empty when they look fine): constant, or far out of range."""
    mapped = unclipped(raw, cfg)
    width = cfg.clip_high - cfg.clip_low
    problems = []
    if mapped.numel() > 1 and float(mapped.max() - mapped.min()) <= 1e-6 * max(1.0, width):
        problems.append(
            f"the reward model gave the same score {float(mapped[0]):.4g} to {mapped.numel()} different "
            "probe samples: check reward.model.index / token and that the model was trained"
        )
    far = (mapped < cfg.clip_low - width) | (mapped > cfg.clip_high + width)
    if bool(far.any()):
        problems.append(
            f"reward-model scores {_span(mapped)} (raw {_span(raw)}) are far outside [clip_low, clip_high] = "
            f"[{cfg.clip_low:g}, {cfg.clip_high:g}] and would be clipped flat; set reward.model.scale / shift "
            f"(e.g. shift = {-float(raw.double().mean()):.3g} centres them) or a transform"
        )
    return problems


def _span(x: torch.Tensor) -> str:
    return f"[{float(x.min()):.4g}, {float(x.max()):.4g}]"


def _device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


class RewardModel:
    """Scores (prompt, completion) texts with a local reward model; `score` returns mapped floats."""

    def __init__(self, cfg: RewardModelConfig, probe: bool = True):
        from streamrl.engine.models import load_tokenizer

        if not cfg.path:
            raise ValueError(
                "reward_model is in reward.functions but reward.model.path is empty; give the "
                "folder of a HF sequence-classification or causal-LM reward model"
            )
        self.cfg = cfg
        self.device = _device(cfg.device)
        self.tokenizer = load_tokenizer(cfg.path)
        self.tokenizer.truncation_side = "left"  # keep the completion's end, where the answer is
        self.tokenizer.padding_side = "right"
        self.model = self._load()
        self.column = self._column()
        if probe:
            for problem in range_warnings(self.raw_scores(*map(list, zip(*PROBES))), cfg):
                log.warning("%s", problem)

    def _load(self):
        import transformers

        from streamrl.engine.models import check_model_folder

        check_model_folder(self.cfg.path)
        auto = (
            transformers.AutoModelForSequenceClassification
            if self.cfg.kind == "sequence_classification"
            else transformers.AutoModelForCausalLM
        )
        model = auto.from_pretrained(self.cfg.path, dtype=getattr(torch, self.cfg.dtype))
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        return model.to(self.device).eval()

    def _column(self) -> int:
        cfg = self.cfg
        if cfg.kind == "sequence_classification":
            if cfg.token:
                raise ValueError(
                    "reward.model.token is for kind = 'causal_lm'; a sequence classifier uses "
                    "reward.model.index (the class)"
                )
            size, what = self.model.config.num_labels, "classes (num_labels)"
            index = cfg.index
        else:
            size, what = self.model.get_output_embeddings().weight.shape[0], "tokens in its vocabulary"
            index = self._token_id() if cfg.token else cfg.index
        if index >= size:
            raise ValueError(
                f"reward.model.index = {index} but the reward model has {size} {what}; give an index below {size}"
            )
        return index

    def _token_id(self) -> int:
        ids = self.tokenizer.encode(self.cfg.token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(
                f"reward.model.token = {self.cfg.token!r} is {len(ids)} tokens {ids} for this "
                "tokenizer; give a string that is exactly one token, or its id as reward.model.index"
            )
        return ids[0]

    @torch.inference_mode()
    def raw_scores(self, prompts: list[str], completions: list[str]) -> torch.Tensor:
        """The unmapped logit per sample, [N] float32 on CPU."""
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        out = []
        for start in range(0, len(texts), self.cfg.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.cfg.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.cfg.max_length,
            ).to(self.device)
            logits = self.model(**enc).logits
            if logits.dim() == 3:  # causal LM [B, T, V]: the logit at each row's last real token
                last = (enc["attention_mask"].sum(dim=1) - 1).clamp(min=0)
                logits = logits[torch.arange(logits.shape[0], device=logits.device), last]
            out.append(logits[:, self.column].float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def score(self, prompts: list[str], completions: list[str]) -> list[float]:
        return map_scores(self.raw_scores(prompts, completions), self.cfg).tolist()
