"""The run folder's disk fills up mid-run (a real filesystem: a tmpfs mounted for the test, tests/conftest.py
`small_disk`; the fill is a file written until ENOSPC once a checkpoint exists). Redis cannot append to its
append-only file and refuses every write (MISCONF); the ledger is handled as a lost one: `streamrl run`
says so in one line naming the cause and the folder, exits 5, stops every process without a traceback in
any log, and leaves RUN/end.json and books that balance for `--resume latest`.

One run, read by each test; hf nodes, as in test_run_replacement.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from streamrl.engine.ledger import Ledger
from streamrl.engine.redis_server import RedisServer, connect

pytestmark = [pytest.mark.faults, pytest.mark.slow]

DISK_KIB = 12 << 10  # the start (keys, config, a checkpoint's room) and 3 checkpoints of the tiny model fit
DRIVER = pathlib.Path(__file__).with_name("full_disk_driver.py")


@pytest.fixture(scope="module")
def full(tmp_path_factory, small_disk, fault_tools):
    folder = tmp_path_factory.mktemp("full_disk")
    disk, kept = folder / "disk", folder / "kept"
    disk.mkdir()
    kept.mkdir()
    sets = [*fault_tools.run_settings, "rollout.backend='hf'", "run.steps=100000", f"run.dir='{disk}'"]
    sets += ["run.name='full'", *fault_tools.at_test_settings(["ledger.retry_s=5", "checkpoint.min_interval_s=5"])]
    command = [*small_disk(disk, DISK_KIB), sys.executable, str(DRIVER), str(folder), str(disk), "full", "3"]
    command += [a for s in sets for a in ("--set", s)]
    driver = subprocess.Popen(command, env={**os.environ, "KEEP": str(kept)}, start_new_session=True)
    children: dict[int, str] = {}  # every process below the driver (the pid namespace is the test's own)
    try:
        deadline = time.monotonic() + 900
        while driver.poll() is None and time.monotonic() < deadline:
            found = fault_tools.descendants(driver.pid).items()
            children.update({pid: line for pid, line in found if "streamrl" in line or "redis-server" in line})
            time.sleep(0.5)
        gone_by = time.monotonic() + 15  # orphans are reaped by init
        while any(fault_tools.running(pid) for pid in children) and time.monotonic() < gone_by:
            time.sleep(0.2)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)  # the driver and streamrl run; its children follow it (lifeline)
    record = json.loads((folder / "driver.json").read_text())
    record.update(
        children=len(children), left={pid: line for pid, line in children.items() if fault_tools.running(pid)}
    )
    said = (folder / "run.out").read_text(errors="replace")
    run = kept / "full"
    with RedisServer(run / "redis") as server:  # the ledger as a resume would find it, from the kept folder
        ledger = Ledger(connect(server.url), "full")
        books, counts, finished = ledger.check(deep=True), ledger.counts(), ledger.finished()
        ledger.client.close()
    logs = {p.name: p.read_text(errors="replace") for p in (run / "logs").iterdir()}
    fault_tools.figure("run_full_disk", exit_code=record["exit_code"], disk_kib=record["disk_kib"],
                       exit_s=round(record["exited_at"] - record.get("filled_at", record["exited_at"]), 1),
                       steps_at_fill=record.get("steps_at_fill"), in_flight=counts.in_flight, lost=len(books),
                       children=record.get("children"), left=len(record.get("left", {})),
                       traceback=any("Traceback" in text for text in [said, *logs.values()]))  # fmt: skip
    return dict(record=record, said=said, run=run, books=books, counts=counts, finished=finished, logs=logs)


def test_the_disk_filled_mid_run_and_the_run_exits_5(full):
    record = full["record"]
    assert "filled_at" in record, full["said"][-3000:]  # it ran past a checkpoint and 3 steps, then filled
    assert record["exit_code"] == 5, full["said"][-3000:]


def test_every_process_of_the_run_is_stopped(full):
    record = full["record"]
    assert record["children"] >= 5 and record["left"] == {}  # streamrl run, Redis, the learner, 2 nodes: none left


def test_one_line_names_the_cause_and_the_folder(full):
    errors = [line for line in full["said"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1, full["said"][-3000:]
    assert "the ledger cannot write" in errors[0] and "No space left on device" in errors[0]
    assert f"{full['run'].parent.parent / 'disk' / 'full' / 'redis'}" in errors[0]
    assert "--resume latest --set run.name=full" in errors[0]  # a checkpoint was saved before the disk filled


def test_no_traceback_on_the_console_or_in_any_log(full):
    assert "Traceback" not in full["said"]
    assert {name: "Traceback" in text for name, text in full["logs"].items()} == dict.fromkeys(full["logs"], False)
    # the logs were written through the fill: the learner's last words are there
    assert "refused writes" in full["logs"]["learner-rank0.log"] and "MISCONF" in full["logs"]["learner-rank0.log"]


def test_end_json_says_how_the_run_ended(full):
    ending = json.loads((full["run"] / "end.json").read_text())
    assert (ending["ended"], ending["exit"]) == ("stopped: the ledger cannot write", 5)
    assert (
        ending["detail"].startswith("Redis refused writes: MISCONF") and "No space left on device" in ending["detail"]
    )


def test_the_books_balance_for_a_resume(full):
    assert full["books"] == []  # every record agrees with the counters in the append-only file left on disk
    counts = full["counts"]
    assert counts.total == counts.trained + counts.dropped + counts.in_flight and counts.trained > 0
    assert full["finished"] is None  # not marked finished: a resume takes it up
    assert list((full["run"] / "checkpoints").glob("step_*/meta.json"))
