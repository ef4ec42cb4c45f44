"""The peer run (bench/trl_peer.py) trains TRL's GRPOTrainer on streamrl's own config: the demo's prompts, its
reward by name, its group size and step shape; TRL's own generation on CPU (vLLM colocate is for a GPU). Then
bench/one_gpu_vs_trl.py puts it beside a real `streamrl run` of the same config: one figure, one plot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_trl_trains_the_demo_with_streamrls_reward_and_step_shape_and_stands_beside_a_streamrl_run(tmp_path):
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

    sets = ["rollout.max_tokens=4", "learner.groups_per_step=2", "rollout.backend='hf'", f"run.dir='{tmp_path}'",
            "run.name='ours'", "telemetry.tensorboard=false"]  # fmt: skip
    cmd = [sys.executable, "-m", "streamrl", "run", "--steps", "3", "--rollout-nodes", "1", "--device", "cpu"]
    done = subprocess.run([*cmd, *(a for s in sets for a in ("--set", s))], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    _assert_the_comparison(tmp_path / "ours", out, steps, tmp_path / "reward.png")


def _assert_the_comparison(run, trl_lines, trl_steps: list[dict], png) -> None:
    from streamrl.bench.one_gpu_vs_trl import main as compare
    from streamrl.engine.telemetry import read_metrics

    got = compare([str(run), str(trl_lines), "--plot", str(png)])
    records = read_metrics(run / "metrics.jsonl")
    assert len(records) == 3 and got["streamrl_steps"] == 3 and got["trl_steps"] == 2 and got["mode"] == "async"
    ours = sum(r["completion_tokens"] for r in records[1:]) / (records[-1]["time"] - records[0]["time"])
    theirs = trl_steps[1]["completion_tokens"] / (trl_steps[1]["wall_s"] - trl_steps[0]["wall_s"])
    assert got["streamrl_tok_s"] == pytest.approx(ours, abs=0.1) and got["trl_tok_s"] == pytest.approx(theirs, abs=0.1)
    assert got["ratio"] == round(got["streamrl_tok_s"] / got["trl_tok_s"], 3) and got["trl_vllm"] is False
    assert got["streamrl_reward_last"] == round(records[-1]["reward/mean"], 4)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a TRL run cut at its limit has no trl_run line: its peak is the last step's (on a GPU; None on CPU)
    cut = trl_lines.with_name("trl-cut.jsonl")
    cut.write_text("".join(json.dumps({**s, "peak_gib": 3.5 + s["step"]}) + "\n" for s in trl_steps))
    got = compare([str(run), str(cut)])
    assert got["trl_steps"] == 2 and got["trl_peak_gib"] == 5.5 and got["trl_vllm"] is None
    assert all("peak_gib" in s for s in trl_steps)
