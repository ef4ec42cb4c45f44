"""The peer run (bench/trl_peer.py) trains TRL's GRPOTrainer on streamrl's own config: the demo's prompts, its
reward by name, its group size and step shape; TRL's own generation on CPU (vLLM colocate is for a GPU)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_trl_trains_the_demo_with_streamrls_reward_and_step_shape(tmp_path):
    pytest.importorskip("trl", reason="the test extra installs trl")
    from streamrl.bench.trl_peer import main

    out = tmp_path / "trl.jsonl"
    main(["--steps", "2", "--set", "rollout.max_tokens=4", "--set", "learner.groups_per_step=2", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    steps, (run,) = lines[:-1], lines[-1:]
    assert [s["step"] for s in steps] == [1, 2] and run["figure"] == "trl_run" and run["steps"] == 2
    assert run["completions_per_step"] == 2 * 8  # learner.groups_per_step x the demo's rollout.group_size
    for s in steps:  # the demo reward: a share of letters, in [0, 1]; at most 4 tokens a completion
        assert 0.0 <= s["reward_mean"] <= 1.0 and 0 < s["completion_tokens"] <= 16 * 4
    assert run["trained_tok_s"] > 0 and run["vllm"] is False
