"""One run, one owner of its folder (ops/lock.py), on real `streamrl run` processes: a second launcher started
before either learner is up, one started mid-run and a `--resume latest` on the live run each exit 2 within
10 s and change nothing (config.toml and learner.json hashed, no end.json, no process of theirs on the folder);
`streamrl status` reads the live run without starting a process; the live run, stopped by Ctrl-C after the
checks, ends with exact books. Then torn lines in the folder's files are skipped and counted, a Ctrl-C'd run
resumes from the step it stopped at, and the resumed launch's closing line counts only its own steps.

Simulated generation and training (simulate.gen_s / train_s: the tiny model loads, nothing is sampled), hf
nodes' cost being beside the point: one run shared by the owner tests, one stopped-and-resumed run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from streamrl.engine.telemetry import read_jsonl
from streamrl.ops.closing import closing_line

pytestmark = [pytest.mark.faults, pytest.mark.slow]
_spec = importlib.util.spec_from_file_location("ctrl_c", pathlib.Path(__file__).with_name("ctrl_c.py"))
_ctrl_c = importlib.util.module_from_spec(_spec)  # Ctrl-C once a run wrote N steps (test_resume_config.py too)
_spec.loader.exec_module(_ctrl_c)

SIM = _ctrl_c.SIM
REFUSED_S = 10.0  # the bound on a refused launcher's exit
# The live run: live through the checks at step 3 whatever they take (each a fresh `python -m streamrl`: 2-4 s on
# 2 idle cores, a minute for `status` at a load average of 43), then stopped by Ctrl-C
LIVE = ["run.steps=100000"]


class Command:
    """A `streamrl` command as a user types it, its output in FOLDER/LABEL.out; the processes it started, seen by
    polling the process table every 50 ms while it runs (a redis-server takes longer than that to come up)."""

    def __init__(self, folder, label: str, args: list[str], descendants):
        self.out = folder / f"{label}.out"
        env = {**os.environ, "COLUMNS": "300"}
        with self.out.open("wb") as sink:
            self.process = subprocess.Popen([sys.executable, "-m", "streamrl", *args], stdout=sink,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)  # fmt: skip
        self.started = time.monotonic()
        self.seen: dict[int, str] = {}
        self._descendants = descendants
        self._watch = threading.Thread(target=self._poll, daemon=True)
        self._watch.start()

    def _poll(self) -> None:
        while self.process.poll() is None:
            for pid, line in self._descendants(self.process.pid).items():
                described = _described(pid, line)  # '' once it is a zombie: what it was seen as before stays
                self.seen[pid] = described or self.seen.get(pid, "")
            time.sleep(0.05)

    def finish(self, timeout_s: float) -> tuple[int, float]:
        """The exit status and the seconds from the start to the exit."""
        code = self.process.wait(timeout=timeout_s)
        took = time.monotonic() - self.started
        self._watch.join()
        return code, took

    def said(self) -> str:
        return self.out.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _run_args(folder, name: str, *extra: str) -> list[str]:
    sets = [*SIM, f"run.dir='{folder}'", f"run.name='{name}'", *extra]
    return ["run", "--rollout-nodes", "1", *[a for s in sets for a in ("--set", s)]]


def _status_args(run_dir) -> list[str]:
    return ["status", "--run", run_dir.name, "--runs-dir", str(run_dir.parent)]


def _hashes(run_dir) -> dict[str, str]:
    return {name: hashlib.sha256((run_dir / name).read_bytes()).hexdigest() for name in ("config.toml", "learner.json")}


def _described(pid: int, line: str) -> str:
    """A process's command line and its working folder (a redis-server rewrites its title to its address, and
    works in its --dir: RUN/redis, or the copy `streamrl status` reads)."""
    try:
        return f"{line} cwd={os.readlink(f'/proc/{pid}/cwd')}"
    except OSError:
        return line


def _on_folder(run_dir, running) -> dict[int, str]:
    """Every process of this machine that works on the run folder: its command line names it (the learner:
    --config RUN/...; a node: --learner RUN) or it works in it (the redis-server, in RUN/redis)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                line = _described(int(entry), open(f"/proc/{entry}/cmdline").read().replace("\0", " "))
            except OSError:
                continue
            if str(run_dir) in line and running(int(entry)):
                found[int(entry)] = line
    return found


def _steps(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(read_jsonl(path)[0]) if path.exists() else 0


@pytest.fixture(scope="module")
def owned(tmp_path_factory, fault_tools):
    folder = tmp_path_factory.mktemp("owner")
    run_dir = folder / "owned"
    tools, found = fault_tools, {}
    # started together: both before either learner is up; the first to own the folder runs it
    a = Command(folder, "a", _run_args(folder, "owned", *LIVE), tools.descendants)
    time.sleep(1.0)
    b = Command(folder, "b", _run_args(folder, "owned", *LIVE), tools.descendants)
    commands = [a, b]
    try:
        deadline = time.monotonic() + REFUSED_S + 20
        while a.process.poll() is None and b.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        second, live = (b, a) if b.process.poll() is not None else (a, b)
        found["together"] = (*second.finish(30), second.said(), dict(second.seen))
        deadline = time.monotonic() + 300
        while _steps(run_dir) < 3 or not (run_dir / "learner.json").exists():
            assert live.process.poll() is None and time.monotonic() < deadline, live.said()[-3000:]
            time.sleep(0.2)
        before, on_folder = _hashes(run_dir), _on_folder(run_dir, tools.running)
        checks = {"mid": _run_args(folder, "owned", *LIVE),  # together: all while the run is live
                  "resume": [*_run_args(folder, "owned", *LIVE), "--resume", "latest"],
                  "status": _status_args(run_dir)}  # fmt: skip
        started = {label: Command(folder, label, args, tools.descendants) for label, args in checks.items()}
        commands += started.values()
        for label, command in started.items():
            found[label] = (*command.finish(120), command.said(), dict(command.seen))
        found["ending_while_live"] = (run_dir / "end.json").exists()
        found["hashes"] = (before, _hashes(run_dir))
        found["on_folder"] = (on_folder, _on_folder(run_dir, tools.running))
        found["steps_at_checks"], found["live_after_checks"] = _steps(run_dir), live.process.poll() is None
        live.process.send_signal(signal.SIGINT)
        found["live"] = live.finish(600), live.said()
        stopped = Command(folder, "stopped-status", _status_args(run_dir), tools.descendants)  # the positive control
        commands.append(stopped)
        found["stopped_status"] = (*stopped.finish(120), stopped.said(), dict(stopped.seen))
    finally:
        for command in commands:
            command.kill()
    found["run_dir"] = run_dir
    tools.figure("run_owner_refused", **{f"{label}_exit_s": round(found[label][1], 1) for label in
                 ("together", "mid", "resume", "status")}, load=os.getloadavg()[0])  # fmt: skip
    return found


def test_a_launcher_started_with_the_first_is_refused_in_seconds_and_starts_nothing(owned):
    code, took, said, seen = owned["together"]
    assert code == 2 and took < REFUSED_S, (code, took, said)
    assert "is live in" in said and "streamrl status --run owned" in said and "run.name=OTHER" in said, said
    assert not seen, seen  # no redis-server, no learner, no node: no child at all


@pytest.mark.parametrize("label", ["mid", "resume"])
def test_a_launcher_on_the_live_run_is_refused_in_seconds_and_starts_nothing(owned, label):
    code, took, said, seen = owned[label]
    assert code == 2 and took < REFUSED_S, (code, took, said)
    assert "is live in" in said and "streamrl status --run owned" in said, said
    assert not seen, seen


def test_the_refused_launchers_changed_nothing_in_the_live_folder(owned):
    before, after = owned["hashes"]
    assert before == after
    assert not owned["ending_while_live"]
    processes_before, processes_after = owned["on_folder"]
    assert set(processes_after) <= set(processes_before), (processes_before, processes_after)
    assert sum(f"cwd={owned['run_dir'] / 'redis'}" in line for line in processes_before.values()) == 1, processes_before
    assert sum(" learner " in line for line in processes_before.values()) == 1, processes_before


def test_status_reads_the_live_run_without_starting_a_process(owned):
    code, _, said, seen = owned["status"]
    assert code == 0 and re.search(r"│ run +│ +running +│", said), said
    assert not seen, seen
    # the positive control: on the stopped run, status starts its own server on a copy of the ledger
    code, _, said, seen = owned["stopped_status"]
    assert code == 0 and "books balance" in said, said
    assert any("redis-server" in line and "cwd=" in line and "streamrl-status-" in line for line in seen.values()), seen


def test_the_live_run_ends_with_exact_books(owned):
    (code, _), said = owned["live"]
    assert code == 130, said[-3000:]  # its Ctrl-C after the checks
    assert re.search(r"books balance: (\d+) = \1 trained \+ 0 dropped \+ 0 in flight", said), said[-2000:]
    assert owned["live_after_checks"]  # the checks ran while it was live
    steps = [r["step"] for r in read_jsonl(owned["run_dir"] / "metrics.jsonl")[0]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= owned["steps_at_checks"] >= 3


def test_torn_lines_are_skipped_and_counted(owned, fault_tools):
    run_dir = owned["run_dir"]
    clean_line = closing_line(run_dir, since=0.0, wall_s=60.0, resumed=False)
    clean_status = subprocess.run([sys.executable, "-m", "streamrl", *_status_args(run_dir)], capture_output=True,
                                  text=True, env={**os.environ, "COLUMNS": "300"}, timeout=120)  # fmt: skip
    for name in ("metrics.jsonl", "events.jsonl"):  # as a full disk cuts a record: mid-line, no newline
        with open(run_dir / name, "a") as f:
            f.write('{"step": 99999, "time": 17966')
    ending = (run_dir / "end.json").read_text()
    (run_dir / "end.json").write_text(ending[: len(ending) // 2])
    first, *rest = closing_line(run_dir, since=0.0, wall_s=60.0, resumed=False).splitlines()
    clean_first, *clean_rest = clean_line.splitlines()
    assert first == f"{clean_first} (1 torn line(s) of metrics.jsonl, 1 of events.jsonl, a torn end.json skipped)"
    assert rest == clean_rest
    status = subprocess.run([sys.executable, "-m", "streamrl", *_status_args(run_dir)], capture_output=True,
                            text=True, env={**os.environ, "COLUMNS": "300"}, timeout=120)  # fmt: skip
    assert status.returncode == clean_status.returncode == 0, status.stdout + status.stderr
    assert "end.json is torn: skipped" in status.stdout
    assert _rows(status.stdout) == _rows(clean_status.stdout)  # every row but how it ended (the ending is torn)
    assert status.stdout.count("books balance") == clean_status.stdout.count("books balance") == 1


def _rows(table: str) -> dict[str, str]:
    """`streamrl status`'s rows but `run` (how it ended), by name: `│ name │ value │` (the widths follow the text)."""
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines()]
    return {c[0]: c[1] for c in cells if len(c) == 2 and c[0] != "run"}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A run stopped by SIGINT (Ctrl-C) once it wrote step 3, before the default cadence's first checkpoint; then
    `--resume latest` to its end."""
    folder = tmp_path_factory.mktemp("resumed")
    run_dir = folder / "stopped"
    args = [sys.executable, "-m", "streamrl", *_run_args(folder, "stopped", "run.steps=8", "simulate.gen_s=1.0")]
    env = {**os.environ, "COLUMNS": "300"}
    first = _ctrl_c.ctrl_c_after(args, run_dir, 3)
    steps_before = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")[0]]
    second = subprocess.run([*args, "--resume", "latest"], capture_output=True, text=True, env=env, timeout=600)
    found = dict(first=first, steps_before=steps_before, second=second, run_dir=run_dir)
    found["steps_resumed"] = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")[0]]
    again = [*args, "--set", "run.steps=2"]
    found["rerun"] = subprocess.run(again, capture_output=True, text=True, env=env, timeout=600)  # refused: trained
    found["fresh"] = subprocess.run([*again, "--fresh"], capture_output=True, text=True, env=env, timeout=600)
    return found


def test_ctrl_c_saves_and_resume_continues_from_the_step_it_stopped_at(resumed):
    code, said = resumed["first"]
    assert code == 130, said[-2000:]
    stopped_at = resumed["steps_before"][-1]
    assert stopped_at >= 3 and resumed["steps_before"] == list(range(1, stopped_at + 1))
    second = resumed["second"]
    assert second.returncode == 0, second.stdout[-3000:]
    assert resumed["steps_resumed"] == list(range(1, 9))  # continued from the stopped step: none repeated or missing


def test_the_resumed_closing_line_counts_only_its_own_steps(resumed):
    stopped_at = resumed["steps_before"][-1]
    said = resumed["second"].stdout
    line = rf"resumed at step {stopped_at}; {8 - stopped_at} steps since, in \d+ s; .*; "
    line += rf"earlier launches wrote {stopped_at} steps \(the last: step {stopped_at}\)"
    assert re.search(line, said), said[-2000:]


def test_a_trained_run_starts_afresh_only_when_asked_its_books_kept_aside(resumed):
    rerun, fresh, run_dir = resumed["rerun"], resumed["fresh"], resumed["run_dir"]
    assert rerun.returncode == 2 and "streamrl run --fresh" in rerun.stdout, rerun.stdout[-2000:]  # never silently
    assert fresh.returncode == 0, fresh.stdout[-3000:]
    [aside] = (run_dir / "earlier").iterdir()
    assert f"its earlier books are kept in {aside}" in fresh.stdout
    assert [r["step"] for r in read_jsonl(aside / "metrics.jsonl")[0]] == list(range(1, 9))
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")[0]] == [1, 2]
    assert re.search(r"books balance: (\d+) = \1 trained \+ 0 dropped \+ 0 in flight", fresh.stdout)
