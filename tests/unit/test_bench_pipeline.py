"""The pipeline bench's arithmetic: the async gain against sync, and against the ideal overlap of the
stages (simulated, or measured in the sync run)."""

import pytest

from streamrl.bench.pipeline import speedups


def _line(config, mode, staleness, tokens_per_s, **stages):
    return {"config": config, "mode": mode, "max_staleness": staleness, "tokens_per_s": tokens_per_s, **stages}


def test_measured_stages_give_the_ideal_when_nothing_is_simulated():
    sync = _line("sync", "sync", 0, 1000.0, gen_s=2.4, train_s=0.4)
    lines = [sync, _line("async-s0", "async", 0, 1000.0), _line("async-s1", "async", 1, 1120.0)]
    s0, s1 = speedups(lines, simulate={})
    assert s0["ideal_ratio"] == 1.0  # staleness 0 cannot overlap the stages
    assert s1["ratio"] == pytest.approx(1.12)
    assert s1["ideal_ratio"] == pytest.approx(2.8 / 2.4)
    assert s1["fraction_of_ideal"] == pytest.approx(1.12 / (2.8 / 2.4))
    assert s1["stages"] == "measured in sync"


def test_simulated_stages_win_over_measured_ones_and_no_sync_gives_no_gain():
    sync = _line("sync", "sync", 0, 100.0, gen_s=5.0, train_s=0.1)
    (s1,) = speedups([sync, _line("async-s1", "async", 1, 190.0)], simulate={"gen_s": 1.0, "train_s": 1.0})
    assert s1["ideal_ratio"] == 2.0 and s1["fraction_of_ideal"] == pytest.approx(0.95)
    assert s1["stages"] == "simulated"
    assert speedups([_line("async-s1", "async", 1, 190.0)], simulate={}) == []


def test_the_nodes_own_generating_time_gives_a_second_ideal():
    from streamrl.bench.pipeline import _node_clocks

    first = {"node/a/generate_s": 10.0, "node/a/idle_s": 5.0, "node/a/swap_s": 0.0}
    last = {"node/a/generate_s": 20.0, "node/a/idle_s": 25.0, "node/a/swap_s": 1.0, "node/b/idle_s": 2.0}
    assert _node_clocks(last, first) == {"generate": 10.0, "idle": 22.0, "swap": 1.0}
    assert _node_clocks({"reward/mean": 1.0}, first) == {}
    sync = _line("sync", "sync", 0, 1000.0, gen_s=2.5, train_s=1.0, node_generate_s=1.0)
    (s1,) = speedups([sync, _line("async-s1", "async", 1, 1500.0)], simulate={})
    assert s1["ideal_ratio"] == pytest.approx(3.5 / 2.5)
    assert s1["ideal_ratio_node_clock"] == pytest.approx(2.0) and s1["fraction_of_ideal_node_clock"] == 0.75
