"""Run inside a small disk (tests/conftest.py `small_disk`) by test_run_full_disk.py: `streamrl run` with its
folder on that disk; once a checkpoint and `steps` step records exist, the disk is filled (a file written
until ENOSPC); then the run is waited for. What happened goes to OUT/driver.json, the console to OUT/run.out.

    python full_disk_driver.py OUT DISK NAME STEPS --set ... [--set ...]
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time


def main() -> None:
    out, disk, name, steps = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    run_dir = disk / name
    command = [sys.executable, "-m", "streamrl", "run", "--rollout-nodes", "2", *sys.argv[5:]]
    env = {**os.environ, "COLUMNS": "1000"}  # a line is a line: no wrapping
    with (out / "run.out").open("wb") as sink:
        run = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    record: dict = {"disk_kib": os.statvfs(disk).f_blocks * os.statvfs(disk).f_frsize // 1024}
    deadline = time.monotonic() + 600
    while run.poll() is None and time.monotonic() < deadline:
        saved = list(run_dir.glob("checkpoints/step_*/meta.json"))
        metrics = run_dir / "metrics.jsonl"
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if saved and done >= steps:
            record.update(steps_at_fill=done, checkpoints_at_fill=len(saved), filled_at=time.time())
            record["filled_kib"] = _fill(disk / "filler") // 1024
            break
        time.sleep(0.25)
    record["exit_code"] = run.wait(timeout=600)
    record["exited_at"] = time.time()
    (out / "driver.json").write_text(json.dumps(record))


def _fill(path: pathlib.Path) -> int:
    """Write zeros to `path` until the disk is full; the bytes written."""
    written, chunk = 0, bytes(64 << 10)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(chunk)
            except OSError:
                break
        for size in (4096, 512, 1):  # the last pages
            try:
                while True:
                    written += f.write(bytes(size))
            except OSError:
                continue
    return written


if __name__ == "__main__":
    main()
