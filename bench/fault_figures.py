"""The fault suite's figures at one of its settings: runs `tests/integration/faults` and prints its
`FIGURE {...}` lines (one per row of docs/RELIABILITY.md), then how long the suite took.

    python -m streamrl.bench.fault_figures --settings default [-k EXPR] [--log FILE]

`--settings test` (what CI runs): heartbeat TTL 4 s, weights deadline 8 s, a few shortened bounds, so
each fault costs seconds. `--settings default`: the defaults a user gets (TTL 15 s, weights 60 s,
ledger retry 30 s, stall stop 1800 s); slower. Run from the repository's parent folder (or with
`streamrl` importable); the whole pytest output goes to `--log`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import streamrl

FIGURE = re.compile(r"FIGURE (\{.*\})\s*$")


def run_suite(settings: str, select: str, log: pathlib.Path) -> tuple[list[dict], int, float]:
    """The suite's FIGURE records, pytest's exit status and the wall seconds."""
    tests = pathlib.Path(streamrl.__file__).parent / "tests" / "integration" / "faults"
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(tests)]
    command += ["-k", select] if select else []
    env = {**os.environ, "STREAMRL_FAULT_SETTINGS": settings}
    started = time.monotonic()
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
    # a FIGURE line may follow pytest's progress dots on the same line
    figures = [json.loads(found.group(1)) for found in map(FIGURE.search, log.read_text().splitlines()) if found]
    return figures, code, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", choices=("test", "default"), default="default")
    parser.add_argument("-k", dest="select", default="", help="pytest -k expression: some of the tests")
    parser.add_argument("--log", type=pathlib.Path, default=pathlib.Path("fault_figures.log"))
    args = parser.parse_args()
    figures, code, wall_s = run_suite(args.settings, args.select, args.log)
    for figure in figures:
        print(f"FIGURE {json.dumps(figure, sort_keys=True)}")
    print(json.dumps({"figure": "fault_suite", "settings": args.settings, "pytest_exit": code,
                      "rows": len(figures), "wall_s": round(wall_s, 1)}))  # fmt: skip
    sys.exit(code)


if __name__ == "__main__":
    main()
