"""Logs and metrics: only learner rank 0 speaks; every role writes its own log file in the run folder.

- `setup_logging(run_dir, role, console)`: `RUN/logs/<role>.log` always; the console only where
  `console` is true (learner rank 0, or a rollout node started by hand).
- `MetricsSink`: one JSON object per learner step in `RUN/metrics.jsonl`; and, as configured,
  TensorBoard events, a Prometheus endpoint (`prometheus_client`) and Weights & Biases.
- `MetricsTail`: reads a metrics.jsonl as it grows, only the new lines each time (the live view),
  through `LineTail` (the complete lines appended to a file, which the live view also reads logs with);
  `read_metrics(path)` reads a whole one (tests, benchmarks).
- `EventLog`: `RUN/events.jsonl`, what the roles tell the live view (`ops/phases.py`), one JSON object a
  line, `{"t", "role", "event", ...}`: a node's phases and live versions, the learner coming up, its
  roster (nodes joined, left, evicted, lost: written by `NodeRegistry`, their one owner), its waits
  and steps. The view reads these, not log lines; every role appends to the one file.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import pathlib
import re
import time
from typing import Any

from streamrl.engine.config import TelemetryConfig

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(run_dir: str | pathlib.Path, role: str, console: bool, level: str = "INFO") -> logging.Logger:
    """Configure the root `streamrl` logger for this process and return it."""
    logs = pathlib.Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # A log that cannot be written (a full disk) loses the line; logging's default prints the failure's
    # traceback to stderr, which lands in the run's logs once there is room again.
    logging.raiseExceptions = False
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


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsSink:
    """Rank 0's metrics: jsonl always; TensorBoard, Prometheus and W&B as `cfg` asks."""

    def __init__(self, run_dir: str | pathlib.Path, cfg: TelemetryConfig | None = None):
        cfg = cfg or TelemetryConfig(tensorboard=False)
        run_dir = pathlib.Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fresh_line = not ends_a_line(self.path)  # a crash cut the last record: the next starts below it
        self._file = self.path.open("a", buffering=1)
        self._tb = _tensorboard_writer(run_dir / "tensorboard") if cfg.tensorboard else None
        self._prometheus = _Prometheus(cfg.prometheus_host, cfg.prometheus_port) if cfg.prometheus_port else None
        self._wandb = _wandb_run(run_dir, cfg) if cfg.wandb else None
        self.unwritten = 0  # records the disk refused (full): the run goes on without them

    @property
    def prometheus_port(self) -> int | None:
        return self._prometheus.port if self._prometheus is not None else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, "time": time.time(), **{k: _finite(v) for k, v in metrics.items()}}
        numeric = _numeric(metrics)
        try:
            self._file.write("\n" * self._fresh_line + json.dumps(record) + "\n")
            self._fresh_line = False
            if self._tb is not None:
                for key, value in numeric.items():
                    self._tb.add_scalar(key, value, step)
                self._tb.flush()
        except OSError as e:  # a full disk: training goes on; the ledger, which cannot write either, ends it
            self.unwritten += 1
            self._fresh_line = True  # part of the record may be on disk: the next one starts on a line of its own
            if self.unwritten == 1:
                logging.getLogger("streamrl").warning("metrics of step %d not written to %s: %s", step, self.path, e)
        if self._prometheus is not None:
            self._prometheus.set({"step": float(step), **numeric})
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        try:
            self._file.close()
            if self._tb is not None:
                self._tb.close()
        except OSError:
            pass  # the last buffered lines, on a full disk: counted in `unwritten` already when they failed
        if self._prometheus is not None:
            self._prometheus.close()
        if self._wandb is not None:
            self._wandb.finish()
            # finish() can return before wandb's service has written the run's records; the teardown
            # waits for it, so what a run logged is on disk when the sink is closed
            import wandb

            wandb.teardown()


def _tensorboard_writer(folder: pathlib.Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        logging.getLogger("streamrl").warning(
            "telemetry.tensorboard = true but tensorboard is not installed: no events are written "
            "(`pip install tensorboard`, or set telemetry.tensorboard = false)"
        )
        return None
    return SummaryWriter(str(folder))


class _Prometheus:
    """A gauge per metric (`streamrl_<name>`, created when first seen) on the run's own registry."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        self._gauges: dict[str, Any] = {}
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port

    def set(self, values: dict[str, float]) -> None:
        from prometheus_client import Gauge

        for key, value in values.items():
            gauge = self._gauges.get(key)
            if gauge is None:
                name = "streamrl_" + re.sub(r"[^A-Za-z0-9_]", "_", key)
                gauge = self._gauges[key] = Gauge(name, f"streamrl metric {key}", registry=self.registry)
            gauge.set(value)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _wandb_run(run_dir: pathlib.Path, cfg: TelemetryConfig):
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "telemetry.wandb = true but wandb is not installed: `pip install wandb` (or ./install.sh), "
            "or set telemetry.wandb = false"
        ) from None
    return wandb.init(
        project=cfg.wandb_project, name=run_dir.name, dir=str(run_dir), mode=cfg.wandb_mode, reinit="finish_previous"
    )


class LineTail:
    """The complete lines appended to a text file since the last `poll()` (from byte `offset` on); a
    half-written last line waits for the next poll."""

    def __init__(self, path: str | pathlib.Path, offset: int = 0):
        self.path, self.offset = pathlib.Path(path), offset
        self._partial = b""

    def poll(self) -> list[str]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # b"" after a complete last line
        # a progress bar redraws with \r: its last state is the line
        return [line.decode(errors="replace").rsplit("\r", 1)[-1] for line in lines]

    def pending(self) -> bool:
        """Part of a line is read but not its end (a line being written, or one a crash cut short)."""
        return bool(self._partial)


EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends this role's events to `RUN/events.jsonl` (module doc). Each event is one `write` of one line
    to a file opened for appending, so the lines of several processes never interleave."""

    def __init__(self, run_dir: str | pathlib.Path, role: str):
        self.path, self.role = pathlib.Path(run_dir) / EVENTS_FILE, role
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> None:
        """One line, on a line of its own: after a line a crash or a full disk cut short, a newline first (the
        torn line stays one line, which readers skip and count, instead of swallowing this one)."""
        line = (json.dumps({"t": time.time(), "role": self.role, "event": event, **fields}) + "\n").encode()
        try:
            with open(self.path, "ab+") as f:
                end = f.seek(0, os.SEEK_END)
                if end and os.pread(f.fileno(), 1, end - 1) != b"\n":
                    line = b"\n" + line
                f.write(line)
        except OSError as e:  # the view loses a line; the run goes on
            logging.getLogger("streamrl").debug("event %s not written to %s: %s", event, self.path, e)


class MetricsTail:
    """The records of a growing JSON lines file (metrics.jsonl, events.jsonl): `poll()` reads only what was
    appended since the last call. A line that is not a JSON object (torn by a crash or a full disk) is skipped
    and counted in `skipped`; an empty line (a writer's fresh start after one) is not a record."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.records: list[dict[str, Any]] = []
        self.skipped = 0
        self._lines = LineTail(self.path)

    def poll(self) -> list[dict[str, Any]]:
        """The new records (all records so far are in `records`)."""
        new = []
        for line in self._lines.poll():
            record = _record(line)
            if record is not None:
                new.append(record)
            elif line.strip():
                self.skipped += 1
        self.records.extend(new)
        return new

    def finish(self) -> list[dict[str, Any]]:
        """Once no process writes the file any more: a last line without its newline is torn, counted too."""
        self.poll()
        if self._lines.pending():
            self.skipped += 1
        return self.records


def _record(line: str) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    """Every complete record of a metrics.jsonl (a half-written last line is skipped)."""
    return read_jsonl(path)[0]


def read_jsonl(path: str | pathlib.Path) -> tuple[list[dict[str, Any]], int]:
    """Every record of a JSON lines file no process writes any more, and how many torn lines were skipped."""
    tail = MetricsTail(path)
    return tail.finish(), tail.skipped


def ends_a_line(path: str | pathlib.Path) -> bool:
    """The file is missing, empty or ends with a newline (the next record starts on a line of its own)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            return end == 0 or os.pread(f.fileno(), 1, end - 1) == b"\n"
    except OSError:
        return True


ENDING, RESERVE = "end.json", ".reserve"
RESERVE_BYTES = 256 << 10


def keep_reserve(run_dir: str | pathlib.Path) -> None:
    """RUN/.reserve: RESERVE_BYTES written to disk when a run starts, given up only for the run's last words
    (`write_ending`) on a disk that filled up meanwhile. A disk full already keeps none."""
    path = pathlib.Path(run_dir) / RESERVE
    try:
        if path.is_file() and path.stat().st_size >= RESERVE_BYTES:
            return
        with open(path, "wb") as f:
            f.write(bytes(RESERVE_BYTES))
            f.flush()
            os.fsync(f.fileno())  # allocated now, not when the page cache is written back
    except OSError:
        path.unlink(missing_ok=True)


def write_ending(run_dir: str | pathlib.Path, ended: str, code: int, detail: str, by: str = "learner") -> bool:
    """RUN/end.json: how the run ended (`ended`: finished, interrupted, stopped by the stall alarm, ledger lost,
    stopped without an ending, ...), the learner's `exit` status, `detail`, `time`, and who wrote it (`by`:
    the learner as it exits, or the launcher for a learner that could not). On a full disk the reserve
    (`keep_reserve`) makes room for it. False when it could not be written."""
    record = {"ended": ended, "exit": code, "detail": detail, "time": time.time(), "by": by}
    path = pathlib.Path(run_dir) / ENDING
    for attempt in range(2):
        try:
            path.with_suffix(".tmp").write_text(json.dumps(record) + "\n")
            path.with_suffix(".tmp").replace(path)
            return True
        except OSError as e:
            reserve = path.with_name(RESERVE)
            if attempt or e.errno != errno.ENOSPC or not reserve.is_file():
                path.with_suffix(".tmp").unlink(missing_ok=True)
                return False
            reserve.unlink()
    return False


def read_ending(run_dir: str | pathlib.Path) -> dict[str, Any] | None:
    """RUN/end.json, or None while the run runs (a learner removes it when it starts), never ran here, or its
    end.json is torn (`ending_torn` says so: written whole by a rename, only a damaged disk tears it)."""
    try:
        ending = json.loads((pathlib.Path(run_dir) / ENDING).read_text())
    except (OSError, ValueError):
        return None
    return ending if isinstance(ending, dict) and {"ended", "exit", "time"} <= ending.keys() else None


def ending_torn(run_dir: str | pathlib.Path) -> bool:
    """RUN/end.json is there but says nothing readable (read as no ending, and counted as a skip)."""
    return (pathlib.Path(run_dir) / ENDING).is_file() and read_ending(run_dir) is None
