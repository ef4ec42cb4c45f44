import hashlib
import json

import pytest

from streamrl.engine import models


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tiny_model_is_byte_identical_for_the_same_seed(tmp_path):
    a = models.make_tiny_model(tmp_path / "a", seed=3)
    b = models.make_tiny_model(tmp_path / "b", seed=3)
    c = models.make_tiny_model(tmp_path / "c", seed=4)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]


def test_tiny_model_loads_and_generates(tiny_model):
    import torch

    tok = models.load_tokenizer(tiny_model)
    model = models.load_model(tiny_model)
    ids = tok("12 + 7 =", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 4
    assert tok.eos_token == models.EOS and tok.pad_token_id == tok.eos_token_id
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )


def test_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(models.ModelLoadError, match="make-tiny-model"):
        models.load_tokenizer(str(tmp_path / "nothing-here"))


def test_folder_without_config(tmp_path):
    with pytest.raises(models.ModelLoadError, match="no config.json"):
        models.load_model(str(tmp_path))


def test_folder_without_tokenizer_files(tiny_model, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text((__import__("pathlib").Path(tiny_model) / "config.json").read_text())
    with pytest.raises(models.ModelLoadError, match=r"no tokenizer files.*save_pretrained"):
        models.load_tokenizer(str(folder))


def test_unknown_architecture_and_remote_code(tiny_model, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "architectures": ["FancyNetForCausalLM"], "model_type": "fancynet"})
    )
    with pytest.raises(models.ModelLoadError, match="FancyNetForCausalLM is unknown to transformers"):
        models.load_model(str(folder))
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(models.ModelLoadError, match="trust_remote_code=true"):
        models.load_model(str(folder))


def test_tokenizer_without_eos_is_refused(tiny_model, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_model, folder)
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = None
    tok_cfg["pad_token"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(models.ModelLoadError, match="no eos token"):
        models.load_tokenizer(str(folder))
