"""Bucket planning, packing, and the sender/receiver over real gloo groups (no vLLM)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from streamrl.engine import messages, weights
from streamrl.engine.weights import WeightSender, WeightTransferError, plan_buckets


def _layout(buckets):
    return [(b.dtype, b.numel, [(t.name, t.offset, t.numel) for t in b.tensors]) for b in buckets]


def test_plan_buckets_by_dtype_and_size():
    tensors = {
        "a": torch.zeros(2, 3),
        "b": torch.zeros(4),
        "c": torch.zeros(5, dtype=torch.bfloat16),
        "d": torch.zeros(10),
    }
    # 48-byte buckets: a (6 f32 = 24 B) + b (4 f32 -> 40 B) fit; d would make (10 + 10) * 4 = 80 B > 48,
    # so d opens a second f32 bucket; c (bf16) has its own, listed when opened (before d's).
    assert _layout(plan_buckets(tensors, 48)) == [
        ("float32", 10, [("a", 0, 6), ("b", 6, 4)]),
        ("bfloat16", 5, [("c", 0, 5)]),
        ("float32", 10, [("d", 0, 10)]),
    ]


def test_plan_buckets_oversize_tensor_alone_and_tied_sent_once():
    embed = torch.zeros(8, 4)
    tensors = {"small": torch.zeros(2), "embed_tokens.weight": embed, "lm_head.weight": embed, "tail": torch.zeros(3)}
    # 16-byte buckets: embed (128 B) is larger than a bucket: it gets one of its own; lm_head is tied:
    # listed at embed's offset, its bytes not counted again (the bucket stays 32 elements).
    assert _layout(plan_buckets(tensors, 16)) == [
        ("float32", 2, [("small", 0, 2)]),
        ("float32", 32, [("embed_tokens.weight", 0, 32), ("lm_head.weight", 0, 32)]),
        ("float32", 3, [("tail", 0, 3)]),
    ]


def test_plan_buckets_rejects_bad_size():
    with pytest.raises(ValueError, match="bucket_mb"):
        plan_buckets({"a": torch.zeros(1)}, 0)


def test_pack_unpack_roundtrip_and_shape_check():
    tensors = {"w": torch.arange(6.0).view(2, 3), "v": torch.tensor([7.0, 8.0])}
    (spec,) = plan_buckets(tensors, 1 << 20)
    flat = weights.pack_bucket(spec, tensors, "cpu")
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0]
    out = dict(weights.unpack_bucket(spec, flat))
    assert torch.equal(out["w"], tensors["w"]) and torch.equal(out["v"], tensors["v"])
    with pytest.raises(ValueError, match="'v' is float32\\[3\\]"):
        weights.pack_bucket(spec, {"w": tensors["w"], "v": torch.zeros(3)}, "cpu")


def _planted_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45, -3.4e38])
    embed = torch.randn(300, 16, generator=g)
    return {
        "embed": embed,
        "norm": torch.cat([special, torch.randn(11, generator=g)]),
        "proj": torch.randn(40, 16, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-5, 20),
        "head": embed,
    }  # tied: sent once, received under both names


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.int16)
        if t.element_size() == 2
        else t.view(torch.int32)
        if t.element_size() == 4
        else t.view(torch.int64)
    )


RECEIVER = """
import sys, torch
from streamrl.engine import messages, weights
from streamrl.engine.weights import collective
out = {}
for n, line in enumerate(sys.stdin):
    ready = messages.decode_control(bytes.fromhex(line.strip()))
    got = {k: v.clone() for k, v in weights.receive(ready, "cpu", rank=1)}
    torch.save(got, sys.argv[1] + f".{n}")
    print(len(collective._receiver_groups), flush=True)
"""


def test_send_receive_bit_exact_over_two_process_gloo(tmp_path):
    state = _planted_state()
    sender = WeightSender("node-a", timeout_s=30.0)
    child = subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(tmp_path / "got")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        prefixes = []
        for version in (1, 2):  # the second transfer reuses the group built by the first
            ready = sender.prepare(version, plan_buckets(state, 512))
            prefixes.append(ready.group_prefix)
            child.stdin.write(messages.encode(ready).hex() + "\n")
            child.stdin.flush()
            sender.send(state, ready)
            assert child.stdout.readline().strip() == "1"  # one cached group in the receiver
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert prefixes[0] == prefixes[1]
    assert len(ready.buckets) > 2  # 512-byte buckets split the 19 KB embed off from the rest
    for n in (0, 1):
        got = torch.load(tmp_path / f"got.{n}")
        assert got.keys() == state.keys()
        for name, t in state.items():
            assert got[name].dtype == t.dtype and torch.equal(_bits(got[name]), _bits(t)), name


def test_rendezvous_timeout_names_node_and_next_prepare_rebuilds():
    sender = WeightSender("ghost", timeout_s=1.0)
    ready = sender.prepare(3, plan_buckets({"w": torch.ones(4)}, 1024))
    with pytest.raises(WeightTransferError, match="'ghost'.*rendezvous") as info:
        sender.send({"w": torch.ones(4)}, ready)
    assert info.value.node_id == "ghost" and info.value.phase == "rendezvous"
    assert sender.prepare(4, ready.buckets).group_prefix != ready.group_prefix
