"""README's commands run as written, in order, in a folder of their own: one JSON line per command (its exit
status, wall time, the machine's load, and for a run its mean reward over the first and last quarter of its
steps). `python -m streamrl.bench.first_hour --cwd DIR` in a fresh clone is bench/RESULTS.md's transcript.

A line naming `MODEL_DIR` (a real model's command) is skipped; `CMD [--flag]` runs as CMD and as CMD --flag.
`tests/integration/test_readme_env_commands.py` runs "Bring your environment" through the same reading.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SECTIONS = ("Bring your environment", "LoRA", "Recipes")
REAL_MODEL = "MODEL_DIR"


def section_commands(text: str, section: str) -> list[tuple[str, str]]:
    """(group, line) for each indented command of README section `section`: the group is the `- **name**`
    bullet it sits under, else the section's name; `CMD [--flag]` gives CMD and CMD --flag."""
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found, group = [], section
    for line in body.splitlines():
        bullet = re.match(r"- \*\*([\w-]+)\*\*", line)
        if bullet:
            group = bullet.group(1)
        elif line and not line.startswith(" "):
            group = section
        elif re.match(r" {4,}(\w+=\S+ )*(streamrl|python) ", line):
            command = line.split("#", 1)[0].strip()
            optional = re.search(r" \[(--[\w-]+)\]", command)
            if optional:
                base = command.replace(optional.group(0), "")
                found += [(group, base), (group, f"{base} {optional.group(1)}")]
            else:
                found.append((group, command))
    return found


def argv(line: str, extra: dict[str, list[str]] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a README line: leading VAR=value settings, then `streamrl ...` (run with this
    interpreter, `extra[subcommand]` appended) or `python ...`."""
    words = shlex.split(line)
    env = {**os.environ, "COLUMNS": "200"}
    while re.match(r"^[A-Z_]+=", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = os.pathsep.join(p for p in (value, os.environ.get(key, "")) if p) if key == "PYTHONPATH" else value
    program, *args = words
    if program == "streamrl":
        return [sys.executable, "-m", "streamrl", *args, *(extra or {}).get(args[0], [])], env
    if program != "python":
        raise ValueError(f"README line {line!r}: only `streamrl ...` and `python ...` lines are run")
    return [sys.executable, *args], env


def quarters(metrics: pathlib.Path) -> dict:
    """A run's mean reward over the first and the last quarter of its steps (at least one step each)."""
    rewards = [json.loads(line).get("reward/mean") for line in metrics.read_text().splitlines() if line.strip()]
    rewards = [r for r in rewards if r is not None]
    if not rewards:
        return {"steps": 0}
    k = max(1, len(rewards) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return {"steps": len(rewards), "reward_first_quarter": round(first, 3), "reward_last_quarter": round(last, 3),
            "rise": round(last - first, 3)}  # fmt: skip


def run_line(group: str, line: str, cwd: pathlib.Path, timeout_s: float) -> dict:
    """Run one README line in `cwd`; its figures (the run it made, if any: its folder and reward)."""
    before = set((cwd / "runs").iterdir()) if (cwd / "runs").is_dir() else set()
    command, env = argv(line)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
        code, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        code, tail = None, [f"timed out after {timeout_s:g} s"]
    wall = round(time.perf_counter() - start, 1)
    out = {"group": group, "command": line, "exit": code, "wall_s": wall, "load_1min_before": round(load, 1),
           "load_1min_after": round(os.getloadavg()[0], 1), "tail": tail}  # fmt: skip
    made = sorted(set((cwd / "runs").iterdir()) - before) if (cwd / "runs").is_dir() else []
    if made and (made[-1] / "metrics.jsonl").is_file():
        out |= {"run": made[-1].name, **quarters(made[-1] / "metrics.jsonl")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cwd", type=pathlib.Path, default=pathlib.Path.cwd(), help="Folder to run them in.")
    parser.add_argument("--readme", type=pathlib.Path, default=ROOT / "README.md")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="README sections, comma-separated.")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="Longest wait for one command.")
    args = parser.parse_args()
    text = args.readme.read_text()
    for section in args.sections.split(","):
        for group, line in section_commands(text, section):
            if REAL_MODEL not in line:
                print(json.dumps(run_line(group, line, args.cwd, args.timeout_s)), flush=True)


if __name__ == "__main__":
    main()
