"""The `hf` backend's receiver: weights over a real gloo group into a transformers model, in place."""

from __future__ import annotations

import threading

import pytest
import torch

from streamrl.engine.models import tiny_config
from streamrl.engine.weights import WeightSender, WeightTransferError, plan_buckets
from streamrl.rollout.backends.vllm_worker import apply_to_hf_model


def _model(seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(128), dtype=torch.float32).eval()


def _send_in_thread(sender, state, ready):
    errors = []

    def run():
        try:
            sender.send(state, ready)
        except WeightTransferError as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_apply_to_hf_model_copies_every_tensor_in_place_and_keeps_the_tie():
    learner, node = _model(1), _model(2)
    state = learner.state_dict()
    embed_before = node.get_input_embeddings().weight
    assert not torch.equal(embed_before, state["model.embed_tokens.weight"])
    sender = WeightSender("hf-node", timeout_s=20.0)
    ready = sender.prepare(1, plan_buckets(state, 16 * 1024))
    thread, errors = _send_in_thread(sender, state, ready)
    apply_to_hf_model(node, ready, "cpu")
    thread.join(timeout=30)
    assert not errors
    for name, tensor in node.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert node.get_input_embeddings().weight is embed_before  # same Parameter, new values
    assert node.lm_head.weight.data_ptr() == node.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad():
        assert torch.equal(node(ids).logits, learner(ids).logits)


def test_failed_transfer_leaves_the_hf_model_untouched():
    learner, node = _model(1), _model(2)
    before = {k: v.clone() for k, v in node.state_dict().items()}
    sender = WeightSender("hf-node", timeout_s=2.0)
    ready = sender.prepare(1, plan_buckets(learner.state_dict(), 16 * 1024))
    # the learner announces but never sends: the node's receive fails at the rendezvous deadline
    with pytest.raises(WeightTransferError, match="rendezvous"):
        apply_to_hf_model(node, ready, "cpu")
    for name, tensor in node.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_unknown_tensor_name_is_named():
    node = _model(2)
    state = {"model.not_a_layer.weight": torch.ones(4)}
    sender = WeightSender("hf-node", timeout_s=20.0)
    ready = sender.prepare(1, plan_buckets(state, 1024))
    thread, _ = _send_in_thread(sender, state, ready)
    with pytest.raises(WeightTransferError, match="'model.not_a_layer.weight' is not in the model"):
        apply_to_hf_model(node, ready, "cpu")
    thread.join(timeout=30)
