"""The W&B sink in offline mode: a real `wandb` run written to the run folder, no network, no account."""

from __future__ import annotations

import os

from streamrl.engine.config import TelemetryConfig
from streamrl.engine.telemetry import MetricsSink


def test_offline_run_records_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    sink = MetricsSink(tmp_path / "run-a", TelemetryConfig(tensorboard=False, wandb=True))
    for step in range(1, 4):
        sink.log(step, {"loss": 1.0 / step, "reward/mean": step / 10})
    sink.close()
    runs = list((tmp_path / "run-a" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, os.listdir(tmp_path / "run-a" / "wandb")
    (record,) = list(runs[0].glob("*.wandb"))
    data = record.read_bytes()  # the run's protobuf records: metric names travel as plain strings
    assert b"reward/mean" in data and b"loss" in data
