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
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl.bench.learner_step",
            "--shape",
            "tiny",
            "--samples",
            "8",
            "--budget",
            "512",
            "--micro-batches",
            "2",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--profile",
            str(profile),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TORCHDYNAMO_DISABLE="1"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    figure = json.loads(out.stdout.strip().splitlines()[-1])
    assert figure["figure"] == "learner_step_streamrl" + suffix
    assert figure["tokens_per_s"] > 0 and figure["skipped"] == 0.0 and figure["tokens_per_step"] > 512
    assert figure["profiled_step_ms"] > 0 and "aten::" in profile.read_text()


def test_idle_gaps_name_what_the_host_did_while_the_gpu_waited():
    from streamrl.bench.learner_step import idle_gaps

    kernels = [("k1", 0, 100), ("k2", 50, 1000), ("k3", 3000, 3100), ("k4", 3500, 4000), ("k5", 4100, 4200)]
    host = [("step", 0, 5000), ("Optimizer.step", 900, 3050), ("cat", 1200, 1300), ("to", 3050, 3600)]
    gaps = idle_gaps(kernels, host, min_us=300)
    # 1000..3000 (2 ms) under the optimizer (the whole step covers it too, less specifically);
    # 3100..3500 (0.4 ms) under `to`; the 100 us gap at 4000 is under the threshold
    assert gaps == [{"ms": 2.0, "host": ["Optimizer.step", "step"]}, {"ms": 0.4, "host": ["to", "step"]}]


def test_gap_totals_sort_idle_time_by_gap_length():
    from streamrl.bench.learner_step import gap_totals

    # gaps: 10 us (launch), 100 us (stall), 500 us (host behind); overlapping kernels leave no gap
    kernels = [("a", 0, 100), ("b", 110, 200), ("c", 150, 250), ("d", 350, 400), ("e", 900, 1000)]
    assert gap_totals(kernels) == {"under_20us": 0.01, "20us_to_300us": 0.1, "over_300us": 0.5}
