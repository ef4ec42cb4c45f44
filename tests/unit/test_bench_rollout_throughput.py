"""bench/rollout_throughput.py's figure line when one engine family fails: the others' figures are kept, the
failure is named in the line, and the bench exits non-zero (a GPU call once lost the vLLM figures when the hf
child ran out of memory after them)."""

import json

import pytest

from streamrl.bench import rollout_throughput as bench

ROUNDS = [
    {"engine": "raw", "warm_up": False, "tokens_per_s": 100.0},
    {"engine": "node", "warm_up": False, "tokens_per_s": 95.0},
]


def test_a_failed_family_is_named_and_the_others_figures_kept(tmp_path, monkeypatch, capsys):
    def child(args, family, model, groups):
        if family == "hf":
            raise RuntimeError("hf on m: exit 1 (its error is above)")
        return ROUNDS

    monkeypatch.setattr(bench, "_child", child)
    monkeypatch.setattr(bench, "_config_model", lambda args: "m")
    out = tmp_path / "figures.jsonl"
    with pytest.raises(SystemExit, match="1 engine run"):
        bench.main(["--engines", "vllm", "hf", "--out", str(out), "--device", "cpu"])
    (figure,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert figure["node_tok_s"] == 95.0 and figure["raw_tok_s"] == 100.0 and figure["vs_raw"] == 0.95
    assert figure["hf_tok_s"] == 0.0 and figure["hf_error"].startswith("hf on m: exit 1")
    assert "hf on config failed" in capsys.readouterr().err
