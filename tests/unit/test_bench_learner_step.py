"""The learner-step benchmark runs the learner's real code on CPU (tiny shape), so its GPU session cannot
break on something a CPU run would have shown."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("extra, suffix", [([], "_1cpu_tiny"), (["--unit-params", "1"], "_1cpu_3units_tiny")])
def test_learner_step_bench_smoke(tmp_path, extra, suffix):
    profile = tmp_path / "profile.txt"
    out = subprocess.run([sys.executable, "-m", "streamrl.bench.learner_step", "--shape", "tiny", "--samples", "8",
                          "--budget", "512", "--micro-batches", "2", "--warmup", "1", "--steps", "1",
                          "--profile", str(profile), *extra],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, TORCHDYNAMO_DISABLE="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    figure = json.loads(out.stdout.strip().splitlines()[-1])
    assert figure["figure"] == "learner_step_streamrl" + suffix
    assert figure["tokens_per_s"] > 0 and figure["skipped"] == 0.0 and figure["tokens_per_step"] > 512
    assert figure["profiled_step_ms"] > 0 and "aten::" in profile.read_text()
