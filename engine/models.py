"""HF model and tokenizer loading with errors that name the problem and the fix; the tiny model.

`load_tokenizer` / `load_model` check a folder before transformers sees it, because
transformers' own failures (a broken torchvision, a missing tokenizer file, an architecture it
does not know) surface as misleading import or attribute errors.

`make_tiny_model` builds the model every test and the demo use (no hub is reachable here):
a random-init Qwen2 with a byte-level BPE tokenizer trained on seeded synthetic text. The same
seed gives byte-identical files.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
from collections.abc import Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelLoadError(RuntimeError):
    """A model or tokenizer that cannot be used; the message says what is missing and how to fix it."""


def _read_config(folder: pathlib.Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json: it is not a HF model folder. Save the model with "
            f"model.save_pretrained('{folder}'), or make a tiny one: streamrl make-tiny-model {folder}"
        )
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON ({e}); re-save the model with save_pretrained") from None


def _resolve(path: str) -> pathlib.Path | str:
    """A local folder as a Path; anything else that looks like a hub id stays a string."""
    folder = pathlib.Path(path).expanduser()
    if folder.exists():
        if not folder.is_dir():
            raise ModelLoadError(f"model path {folder} is a file; give the folder that holds config.json")
        return folder
    if path.count("/") == 1 and not path.startswith((".", "/", "~")):
        return path  # a hub id: transformers resolves it (where a hub is reachable)
    raise ModelLoadError(
        f"model folder {folder} does not exist. Give an existing folder "
        f"(model.path) or make a tiny one: streamrl make-tiny-model {folder}"
    )


def check_model_folder(path: str, trust_remote_code: bool = False) -> dict:
    """Check a local model folder before loading: config, architecture, remote code, tokenizer files."""
    folder = _resolve(path)
    if isinstance(folder, str):
        return {}
    config = _read_config(folder)
    if config.get("auto_map") and not trust_remote_code:
        raise ModelLoadError(
            f"{folder} ships its own model code (auto_map in config.json); set "
            "model.trust_remote_code=true only if you trust that code"
        )
    if not trust_remote_code:
        _check_architecture(folder, config)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{folder} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); save the "
            f"tokenizer beside the model: tokenizer.save_pretrained('{folder}')"
        )
    return config


def _check_architecture(folder: pathlib.Path, config: dict) -> None:
    import transformers

    for arch in config.get("architectures") or []:
        try:
            getattr(transformers, arch)
        except (AttributeError, ImportError, RuntimeError) as e:
            known = hasattr(transformers.models, config.get("model_type", "").replace("-", "_"))
            if known:
                raise ModelLoadError(
                    f"transformers {transformers.__version__} knows {arch} but cannot import it ({e}). "
                    "A torchvision/torchaudio build that does not match torch causes this: "
                    "pip uninstall -y torchvision torchaudio torchcodec triton (see `streamrl doctor`)"
                ) from None
            raise ModelLoadError(
                f"{folder}: architecture {arch} is unknown to transformers "
                f"{transformers.__version__}; upgrade it (pip install -U transformers)"
            ) from None


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of a model folder, with eos required and pad defaulting to eos."""
    from transformers import AutoTokenizer

    check_model_folder(path, trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(
            f"the tokenizer in {path} has no eos token, so completions could never stop; set "
            "tokenizer.eos_token = '<your end token>' and save_pretrained it again"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """A causal LM from a folder, in `dtype` on `device`, in train mode off."""
    import torch
    from transformers import AutoModelForCausalLM

    check_model_folder(path, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code, attn_implementation="sdpa"
    )
    return model.to(device).eval()


# ---- the tiny model ----------------------------------------------------------------------

WORDS = (
    "alpha",
    "beta",
    "gamma",
    "delta",
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "sun",
    "moon",
    "star",
    "one",
    "two",
    "three",
    "four",
    "five",
    "yes",
    "no",
    "the",
    "a",
    "is",
    "and",
    "of",
)


def synthetic_text(seed: int, lines: int = 2000) -> list[str]:
    """Seeded lines of words, sums and letter runs: enough variety for a small BPE vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        kind = rng.randrange(3)
        if kind == 0:
            out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
        elif kind == 1:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            out.append(f"{a} + {b} = {a + b}")
        else:
            out.append(" ".join(rng.choice("abcdefgh") * rng.randint(1, 4) for _ in range(rng.randint(2, 8))))
    return out


def make_tokenizer(seed: int = 0, vocab_size: int = 512, text: Sequence[str] = (), tokens: Sequence[str] = ()):
    """A byte-level BPE tokenizer trained on `synthetic_text(seed)` (and `text`), wrapped for transformers;
    `tokens` are added whole (one id each, kept when decoding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [EOS, "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator([*synthetic_text(seed), *text], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=EOS, pad_token=EOS, additional_special_tokens=specials[1:]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.add_tokens(list(tokens))
    return tokenizer


def tiny_config(vocab_size: int, **overrides):
    from transformers import Qwen2Config

    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


# The one table of model bodies, as Qwen2Config fields over `tiny_config`'s defaults (the vocabulary is the
# caller's: `make_tiny_model(..., **SHAPES[name])` takes the tokenizer's). The CLI's --shape and bench/ use it.
def _qwen2_body(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, **more):
    return dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        **more,
    )


SHAPES: dict[str, dict] = {
    "tiny": {},  # hidden 64, intermediate 128, 2 layers, 2 heads, 1 kv head, head_dim 32, tied
    # the tiny body with 10x the init scale: a frozen output layer (LoRA) can still make one token likely; at
    # 0.02 its logits stay within about +-1.3 whatever the hidden state (examples/lora.toml)
    "tiny-sharp": dict(initializer_range=0.2),
    "tiny-4h": _qwen2_body(64, 128, 2, 4, 2, 16),  # the learner-step bench's CPU shape: four query heads of 16
    "small": _qwen2_body(256, 768, 4, 4, 2, 64),
    "medium": _qwen2_body(512, 1536, 8, 8, 2, 64),
    "medium-kv4": _qwen2_body(512, 1536, 8, 8, 4, 64),
    "0.5b": _qwen2_body(896, 4864, 24, 14, 2, 64),  # Qwen2-0.5B's layers (its own vocabulary is 151936)
    "1.5b": _qwen2_body(1536, 8960, 28, 12, 2, 128),  # Qwen2.5-1.5B's layers (its own vocabulary is 151936)
    "7b": _qwen2_body(3584, 18944, 28, 28, 4, 128, tie_word_embeddings=False),  # Qwen2-7B's (vocabulary 152064)
}


def make_tiny_model(
    path: str | os.PathLike,
    seed: int = 0,
    vocab_size: int = 512,
    dtype: str = "float32",
    device: str = "cpu",
    **config_overrides,
) -> pathlib.Path:
    """Write a random-init Qwen2 + BPE tokenizer to `path`; the same seed (dtype, device) gives byte-identical
    files. device "cuda" initialises a large shape in seconds; dtype "bfloat16" halves the bytes written.

    `config_overrides` go to the Qwen2 config (e.g. the Qwen2-0.5B body: hidden_size=896, ...);
    `model_vocab_size` makes the embedding larger than the tokenizer's vocabulary; `text` (more lines) and
    `tokens` (whole tokens) go to the tokenizer (`make_tokenizer`).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(seed, vocab_size, config_overrides.pop("text", ()), config_overrides.pop("tokens", ()))
    model_vocab = config_overrides.pop("model_vocab_size", len(tokenizer))  # may exceed the tokenizer's
    config = tiny_config(
        model_vocab,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    fork_devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=fork_devices), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def default_tiny_model(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The built-in tiny model, made once under ~/.cache/streamrl (or `cache_dir`) and reused."""
    root = pathlib.Path(cache_dir or os.environ.get("STREAMRL_CACHE", "~/.cache/streamrl")).expanduser()
    folder = root / "tiny-qwen2-seed0"
    if not (folder / "config.json").is_file():
        tmp = root / f".tiny-qwen2-seed0.{os.getpid()}"
        make_tiny_model(tmp, seed=0)
        try:
            tmp.rename(folder)  # atomic: a concurrent maker loses the race harmlessly
        except OSError:
            if not (folder / "config.json").is_file():
                raise
    return folder
