"""The same batch on 1 and on 2 CPU ranks (torchrun, gloo): same loss, same updated weights."""

import pathlib

import pytest
import torch

WORKER = pathlib.Path(__file__).with_name("fsdp_parity_worker.py")


def run_ranks(torchrun, ranks: int, model_dir: str, out: pathlib.Path, unit_params: int | None = None) -> dict:
    output = torchrun(ranks, WORKER, model_dir, out, *([unit_params] if unit_params else []))
    assert "terminate called" not in output
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("unit_params, units", [(None, 1), (1, 3)], ids=["one-unit", "unit-per-layer"])
def test_one_and_two_ranks_agree(tiny_model, tmp_path, torchrun, unit_params, units):
    """The tiny model as one FSDP unit (the default) and with a unit per decoder layer (as large models shard)."""
    one = run_ranks(torchrun, 1, tiny_model, tmp_path / "one.pt", unit_params)
    two = run_ranks(torchrun, 2, tiny_model, tmp_path / "two.pt", unit_params)
    assert one["fsdp_units"] == two["fsdp_units"] == units
    assert one["micro_batches"] >= 3
    # each rank trained on a share balanced by tokens: within one sample's length of the other's
    low, high = min(two["rank_positions"]), max(two["rank_positions"])
    assert sum(two["rank_positions"]) == sum(one["rank_positions"]) and high - low <= two["largest_sample"]
    for m1, m2 in zip(one["metrics"], two["metrics"]):
        assert m1["skipped"] == m2["skipped"] == 0.0
        assert m2["loss"] == pytest.approx(m1["loss"], abs=1e-5)
        assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
        assert m2["tokens"] == m1["tokens"] and m2["normalizer"] == m1["normalizer"] == 8.0
    # the second step saw the first step's update: losses differ, so the check has teeth
    assert one["metrics"][0]["loss"] != one["metrics"][1]["loss"]
    assert one["state"].keys() == two["state"].keys() and "model.embed_tokens.weight" in one["state"]
    worst = max((one["state"][k] - two["state"][k]).abs().max().item() for k in one["state"])
    assert worst < 1e-5
