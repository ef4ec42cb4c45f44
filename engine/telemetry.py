"""Logs and metrics: only learner rank 0 speaks; every role writes its own log file in the run folder.

- `setup_logging(run_dir, role, console)`: `RUN/logs/<role>.log` always; the console only where
  `console` is true (learner rank 0, or a rollout node started by hand).
- `MetricsSink`: one JSON object per learner step in `RUN/metrics.jsonl`; TensorBoard events when
  tensorboard is installed; a Prometheus text endpoint when a port is given.
- `read_metrics(path)`: what the live view and the tests read back.
"""

from __future__ import annotations

import http.server
import json
import logging
import math
import pathlib
import threading
import time
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(run_dir: str | pathlib.Path, role: str, console: bool, level: str = "INFO") -> logging.Logger:
    """Configure the root `streamrl` logger for this process and return it."""
    logs = pathlib.Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("streamrl")
    logger.setLevel(level)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    file_handler = logging.FileHandler(logs / f"{role}.log")
    file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(file_handler)
    if console:
        stream = logging.StreamHandler()
        stream.setFormatter(logging.Formatter("%(asctime)s %(levelname)s: %(message)s", "%H:%M:%S"))
        logger.addHandler(stream)
    return logger


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep them visible instead of failing the write
    return value


class MetricsSink:
    """Rank 0's metrics: jsonl always, TensorBoard and Prometheus when asked for."""

    def __init__(self, run_dir: str | pathlib.Path, tensorboard: bool = True, prometheus_port: int = 0):
        self.path = pathlib.Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._tb = _tensorboard_writer(pathlib.Path(run_dir) / "tensorboard") if tensorboard else None
        self._latest: dict[str, float] = {}
        self._server = _serve_prometheus(prometheus_port, self) if prometheus_port else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._latest = {"step": float(step), **numeric}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()

    def prometheus_text(self) -> str:
        lines = []
        for key, value in sorted(self._latest.items()):
            name = "streamrl_" + "".join(c if c.isalnum() else "_" for c in key)
            lines.append(f"# TYPE {name} gauge\n{name} {value!r}")
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _tensorboard_writer(folder: pathlib.Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(str(folder))


def _serve_prometheus(port: int, sink: MetricsSink) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            if self.path.rstrip("/") != "/metrics":
                self.send_error(404)
                return
            body = sink.prometheus_text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # keep scrapes out of the logs
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="prometheus", daemon=True).start()
    return server


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics.jsonl (a half-written last line is skipped)."""
    records = []
    try:
        text = pathlib.Path(path).read_text()
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def live_table(records: list[dict[str, Any]], steps: int, nodes: dict[str, bool], elapsed_s: float, note: str = ""):
    """The `streamrl run` live view: the latest step's figures and the nodes' state."""
    from rich.table import Table

    last = records[-1] if records else {}
    first_reward = records[0].get("reward/mean") if records else None
    table = Table(title=f"streamrl — step {last.get('step', 0)}/{steps} — {elapsed_s:.0f} s", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")

    def fmt(key: str, spec: str = ".3f") -> str:
        value = last.get(key)
        return format(value, spec) if isinstance(value, (int, float)) else "-"

    reward = f"{fmt('reward/mean')} ± {fmt('reward/std')}"
    if first_reward is not None and len(records) > 1:
        reward += f"   (step 1: {first_reward:.3f})"
    rows = [
        ("reward", reward),
        ("loss", fmt("loss", ".4f")),
        ("policy version", fmt("version", ".0f")),
        ("tokens/s (trained)", fmt("tokens_per_s", ".0f")),
        ("staleness mean / max", f"{fmt('staleness_mean', '.2f')} / {fmt('staleness_max', '.0f')}"),
        ("mismatch_kl / behavior_kl", f"{fmt('mismatch_kl', '.2e')} / {fmt('behavior_kl', '.2e')}"),
        ("skipped steps", fmt("skipped_steps", ".0f")),
        ("weights push (s)", fmt("weights_s", ".2f")),
        ("nodes", ", ".join(f"{n} {'up' if up else 'down'}" for n, up in nodes.items()) or "-"),
    ]
    for row in rows:
        table.add_row(*row)
    if note:
        table.add_row("note", note)
    return table
