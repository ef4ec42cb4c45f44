"""The KL reference of its own (learner/reference.py) is stored in the compute dtype, gives the logprobs the
fp32-sharded reference gave, and preflight's split counts the bytes it holds (engine/memory.py). CPU,
one-rank FSDP2, the tiny model, in fp32 and in bf16."""

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig

from streamrl.engine import memory
from streamrl.engine.config import build
from streamrl.learner import parallel
from streamrl.learner.main import _policy
from streamrl.learner.reference import build_reference
from streamrl.learner.reference import release as reference_release
from streamrl.learner.train_step import compute_logprobs
from tests.unit.test_lora_reference import _batch


def _cfg(tiny_model, dtype: str):
    return build({"model": {"path": tiny_model, "dtype": dtype}, "loss": {"kl_coef": 0.1}})


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def built(request, tiny_model):
    """A policy as the learner builds it (fp32 master shards, cast to the compute dtype for its forward: what
    the reference was built as before) and the reference; its bytes read as built and with every unit gathered."""
    device = parallel.init_distributed()
    cfg = _cfg(tiny_model, request.param)
    policy, _, compute, _ = _policy(cfg, device)
    ref = build_reference(cfg, device, compute, policy)
    shards = [p.to_local() for p in ref.parameters()]
    for unit in ref.modules():  # every unit gathered at once: one rank's pass, where none reshards until release
        if isinstance(unit, FSDPModule):
            unit.unshard()
    gathered = _bytes(ref.parameters())
    gathered_dtypes = {p.dtype for p in ref.parameters()}
    reference_release(ref)
    yield dict(cfg=cfg, policy=policy, ref=ref, compute=compute, device=device, shards=shards,
               gathered=gathered, gathered_dtypes=gathered_dtypes)  # fmt: skip
    parallel.shutdown()


def test_the_reference_is_stored_in_the_compute_dtype(built):
    assert {s.dtype for s in built["shards"]} == {built["compute"]}
    assert built["gathered_dtypes"] == {built["compute"]}
    assert not any(p.requires_grad for p in built["ref"].parameters())
    # positive control: the policy beside it keeps fp32 master shards whatever it computes in
    assert {p.to_local().dtype for p in built["policy"].parameters()} == {torch.float32}


def test_its_logprobs_are_the_fp32_sharded_ones(built):
    """The policy before its first update is the reference as it was built before (fp32 shards cast to the
    compute dtype for the forward): rounding once at load gives the same bf16 weights, so the same logprobs."""
    policy, ref = built["policy"], built["ref"]
    policy.eval()
    with torch.no_grad():
        for mb in _batch():
            mb = mb.to(built["device"])
            got, want = compute_logprobs(ref, mb), compute_logprobs(policy, mb)
            torch.testing.assert_close(got, want, rtol=0.0, atol=0.0)  # logprobs and entropy
    reference_release(ref)
    policy.train()


def test_preflight_counts_the_bytes_built(built, tiny_model):
    """preflight's line = the shards as stored + the copy the pass gathers, measured: fp32 107,072 x 4 + 107,072
    x 4 = 856,576 bytes; bf16 107,072 x 2 x 2 = 428,288. The old line, 2 bytes a parameter (214,144), was a
    quarter of fp32's and a third of what the bf16 reference held with fp32 shards (107,072 x (4 + 2) = 642,432)."""
    cfg = built["cfg"]
    estimate = memory.learner(cfg, memory.shape_of(AutoConfig.from_pretrained(tiny_model)))
    line = memory.reference_label(cfg)
    measured = _bytes(built["shards"]) + built["gathered"]
    assert estimate.parts[line] * memory.GIB == pytest.approx(measured, rel=1e-3)
    assert cfg.model.dtype in line and "gathered" in line


def test_more_ranks_divide_the_shards_not_the_gathered_copy():
    cfg = build({"model": {"dtype": "bfloat16"}, "loss": {"kl_coef": 0.1}, "learner": {"ranks": 8}})
    # 7,614,699,008 / 8 = 951,837,376 per rank x 2 bytes, + the whole model x 2 bytes gathered for the pass
    assert memory.reference_bytes(cfg, 7_614_699_008) == 951_837_376 * 2 + 7_614_699_008 * 2
