"""Metrics sinks (jsonl, Prometheus via prometheus_client, W&B offline) and the live view's tail."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from streamrl.engine.config import TelemetryConfig
from streamrl.engine.telemetry import MetricsSink, MetricsTail, read_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tail_reads_only_new_lines_and_waits_for_a_half_written_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.poll() == []  # no file yet
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    assert tail.poll() == [{"step": 1}]
    with path.open("a") as f:
        f.write('ss": 0.5}\n' + json.dumps({"step": 3}) + "\n")
    assert tail.poll() == [{"step": 2, "loss": 0.5}, {"step": 3}]
    assert tail.poll() == [] and [r["step"] for r in tail.records] == [1, 2, 3]
    assert read_metrics(path) == tail.records


def test_prometheus_endpoint_serves_the_latest_step_where_configured(tmp_path):
    port = _free_port()
    sink = MetricsSink(tmp_path, TelemetryConfig(tensorboard=False, prometheus_port=port))
    try:
        sink.log(1, {"loss": 0.25, "reward/mean": 0.5, "note": "text is not a metric"})
        sink.log(2, {"loss": 0.125, "reward/mean": 0.75})
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        sink.close()
    assert "streamrl_loss 0.125" in body and "streamrl_reward_mean 0.75" in body and "streamrl_step 2.0" in body
    assert "note" not in body
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_prometheus_binds_only_the_configured_address(tmp_path):
    port = _free_port()
    sink = MetricsSink(tmp_path, TelemetryConfig(tensorboard=False, prometheus_port=port))
    try:
        with pytest.raises(OSError):  # loopback by default: not reachable on another local address
            with socket.create_connection(("127.0.0.2", port), timeout=2):
                pass
    finally:
        sink.close()


def test_how_a_run_ended_is_written_for_status(tmp_path):
    # that a learner starting again removes it ("running" meanwhile) is test_resume_e2e's
    from streamrl.engine.telemetry import read_ending, write_ending
    from streamrl.ops.status import _state

    assert read_ending(tmp_path) is None
    long = "no sample trained for 1800 s: " + "x" * 300  # an error's first line, shown whole
    write_ending(tmp_path, "stopped by the stall alarm", 3, long + "\nthe rest of the message")
    ending = read_ending(tmp_path)
    assert (ending["ended"], ending["exit"], ending["by"]) == ("stopped by the stall alarm", 3, "learner")
    shown = _state(None, ending=ending)  # the ending says it all: the ledger is not asked (the run may be gone)
    assert shown.startswith("stopped by the stall alarm ") and shown.endswith(f": {long} (exit 3)")
