"""The weight broadcast over NCCL between two GPUs (learner on cuda:0, receiver process on cuda:1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.gpu

STATE = """
import torch
def state(device):
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(1000, 64, generator=g)
    sd = {"embed": embed, "w": torch.randn(300, 64, generator=g).to(torch.bfloat16),
          "b": torch.tensor([float("nan"), -0.0, 1e-40, 3e38]), "head": embed}
    return {k: v.to(device) for k, v in sd.items()}
"""

RECEIVER = (
    STATE
    + """
import sys
from streamrl.engine import messages, weights
torch.cuda.set_device("cuda:1")
want = state("cuda:1")
for line in sys.stdin:
    ready = messages.decode_control(bytes.fromhex(line.strip()))
    got = dict(weights.receive(ready, "cuda:1"))
    bad = [k for k, v in want.items() if got[k].device.type != "cuda"
           or not torch.equal(got[k].view(torch.int16 if v.element_size() == 2 else torch.int32),
                              v.view(torch.int16 if v.element_size() == 2 else torch.int32))]
    print("bad:" + ",".join(bad), flush=True)
"""
)

GHOST = """
import time
from streamrl.engine.weights import WeightSender, WeightTransferError, plan_buckets
import torch
sender = WeightSender("ghost", backend="nccl", device="cuda:0", timeout_s=5.0)
sd = {"w": torch.ones(8, device="cuda:0")}
ready = sender.prepare(1, plan_buckets(sd, 1 << 20))
start = time.monotonic()
try:
    sender.send(sd, ready)
except WeightTransferError as e:
    print(f"raised after {time.monotonic() - start:.1f}s: {e}", flush=True)
"""


def _env() -> dict:
    return dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")


@pytest.fixture
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


def test_nccl_transfer_is_bit_exact_and_reuses_the_group(two_gpus):
    from streamrl.engine import messages
    from streamrl.engine.weights import WeightSender, plan_buckets

    namespace: dict = {}
    exec(STATE, namespace)
    sd = namespace["state"]("cuda:0")
    sender = WeightSender("gpu-node", backend="nccl", device="cuda:0", timeout_s=60.0)
    child = subprocess.Popen(
        [sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        prefixes = []
        for version in (1, 2):
            ready = sender.prepare(version, plan_buckets(sd, 64 * 1024))
            prefixes.append(ready.group_prefix)
            assert ready.backend == "nccl" and len(ready.buckets) > 2
            child.stdin.write(messages.encode(ready).hex() + "\n")
            child.stdin.flush()
            sender.send(sd, ready)
            assert child.stdout.readline().strip() == "bad:"
        assert prefixes[0] == prefixes[1]
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=30)


def test_nccl_receiver_that_never_joins_fails_the_rendezvous_in_time(two_gpus):
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", GHOST], capture_output=True, text=True, timeout=120, env=_env())
    assert "raised after" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "'ghost'" in out.stdout and "rendezvous" in out.stdout
    assert time.monotonic() - start < 100
