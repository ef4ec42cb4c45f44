"""A `streamrl run` stopped as a user stops it: Ctrl-C (SIGINT) once its run folder's metrics.jsonl holds a
number of steps (test_run_owner.py, test_resume_config.py); the simulated settings both run."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from streamrl.engine.telemetry import read_jsonl

# Simulated generation and training (simulate.gen_s / train_s: the tiny model loads, nothing is sampled)
SIM = [
    "simulate.gen_s=0.5",
    "simulate.train_s=0.05",
    "run.device='cpu'",
    "telemetry.tensorboard=false",
    "eval.sources=[]",  # simulated nodes run no evaluation job, and the last step would wait for one
]


def steps_of(run_dir) -> list[int]:
    """The steps RUN/metrics.jsonl records, in order ([] before the first)."""
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path)[0]] if path.exists() else []


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def ctrl_c_after(
    args: list[str], run_dir, steps: int, cwd=None, timeout_s: float = 300.0, as_background_job: bool = False
) -> tuple[int, str]:
    """Run `args` (a whole command line) until RUN/metrics.jsonl holds `steps` steps, then SIGINT it; (its exit
    status, its console output). Killed, whatever happened, before this returns. `as_background_job`: started
    with SIGINT ignored, as bash starts a script's `cmd &` (the signal sent is the same)."""
    env = {**os.environ, "COLUMNS": "300"}
    first = subprocess.Popen(
        args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        preexec_fn=_ignore_sigint if as_background_job else None,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while len(steps_of(run_dir)) < steps:
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.1)
        first.send_signal(signal.SIGINT)
        said, _ = first.communicate(timeout=timeout_s)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    return first.returncode, said
