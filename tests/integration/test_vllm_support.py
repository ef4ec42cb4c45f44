"""The head sizes rollout/backends/vllm_support.py allows on CPU are exactly those the CPU attention kernel serves."""

from __future__ import annotations

import pytest

from streamrl.rollout.backends.vllm_support import CPU_HEAD_SIZES

pytestmark = [pytest.mark.vllm]


def test_cpu_head_sizes_match_the_kernel():
    pytest.importorskip("vllm")
    import torch
    from vllm import _custom_ops as ops

    served = {}
    for isa in ("vec", "vec16"):  # what vLLM picks on x86 without AMX: head sizes % 32 == 0, else % 16 == 0
        served[isa] = []
        for size in range(8, 1025, 8):
            try:
                ops.cpu_attn_get_scheduler_metadata(
                    num_reqs=1,
                    num_heads=2,
                    num_kv_heads=1,
                    head_dim=size,
                    seq_lens=torch.tensor([4], dtype=torch.int32),
                    dtype=torch.float32,
                    query_start_loc=torch.tensor([0, 4], dtype=torch.int32),
                    causal=True,
                    sliding_window_size=-1,
                    isa=isa,
                    enable_kv_split=False,
                )
            except RuntimeError as e:
                assert f"Unsupported CPU attention configuration: head_dim={size}" in str(e)
                continue
            served[isa].append(size)
    assert served == {"vec": list(CPU_HEAD_SIZES), "vec16": list(CPU_HEAD_SIZES)}
