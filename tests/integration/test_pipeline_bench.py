"""`streamrl bench pipeline` end to end on CPU with simulated stages: its output schema, the files it
writes, and the sync mode's invariant (no sample is ever stale, nothing generated is thrown away)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PIPELINE_KEYS = {"config", "mode", "max_staleness", "steps", "tokens_per_s", "seconds_per_step",
                 "learner_idle_fraction", "rollout_idle_fraction", "staleness_histogram", "stale_share",
                 "preempted_share", "generated", "trained", "ideal_seconds_per_step", "overhead_s"}  # fmt: skip


def test_sync_and_async_lines_tables_and_plots(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "streamrl", "bench", "pipeline", "--staleness", "1", "--steps", "5",
         "--simulate", "gen=0.4±0.02,train=0.4", "--out", str(tmp_path)],  # fmt: skip
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    by_figure = {}
    for line in lines:
        by_figure.setdefault(line["figure"], []).append(line)
    sync, async1 = by_figure["pipeline"]
    assert PIPELINE_KEYS <= set(sync) and PIPELINE_KEYS <= set(async1)
    assert sync["mode"] == "sync" and async1["config"] == "async-s1"
    # sync: every trained sample came from the weights that trained it; nothing dropped stale or preempted
    assert set(sync["staleness_histogram"]) == {"0"} and sync["stale_share"] == 0 and sync["preempted_share"] == 0
    assert sync["generated"] == sync["trained"]
    (gain,) = by_figure["pipeline_speedup"]
    assert gain["config"] == "async-s1" and gain["ideal_ratio"] == pytest.approx(2.0) and gain["ratio"] > 0
    for name in ("pipeline.md", "pipeline_speed.png", "pipeline_staleness.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| async-s1 |" in (tmp_path / "pipeline.md").read_text()
