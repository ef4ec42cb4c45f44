"""A learner started on a run that already trained refuses unless told to resume: it would otherwise
continue the run's policy versions with fresh weights."""

import subprocess
import sys

from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect


def test_learner_refuses_a_trained_run_without_resume(redis_url, ledger_run, tiny_model, tmp_path):
    ledger = Ledger(connect(redis_url), ledger_run)
    ledger.init_run(groups_per_step=1)
    ledger.publish_version(3, step=3)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl",
            "learner",
            "--set",
            f"ledger.url='{redis_url}'",
            "--set",
            f"run.name='{ledger_run}'",
            "--set",
            f"run.dir='{tmp_path}'",
            "--set",
            f"model.path='{tiny_model}'",
            "--set",
            "telemetry.tensorboard=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "TORCHDYNAMO_DISABLE": "1"},
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "already trained to version 3" in proc.stderr and "--resume latest" in proc.stderr
