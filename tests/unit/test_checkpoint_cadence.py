"""When the learner saves by default (`checkpoint.every = 0`): as often as `checkpoint.budget` allows, the
time since the last save at least its duration / budget and `min_interval_s`, the clock starting at the first
step; and at the last step. The clock and the save itself are stood in for: the saves are real elsewhere
(tests/integration/test_checkpoint_disk.py, the fault runs)."""

import pytest

from streamrl.engine.config import CheckpointConfig
from streamrl.learner import checkpoint, parallel
from streamrl.learner.checkpoint import keeper as keeper_module


class FakeClock:
    """Stands in for time.monotonic in the keeper: moved by hand."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def keeper(tmp_path, tiny_model, monkeypatch):
    """`make(**checkpoint)`: a Keeper over the tiny model whose saves are recorded, each taking 2 s of the
    fake clock."""
    from transformers import AutoModelForCausalLM

    clock, saved = FakeClock(), []
    monkeypatch.setattr(keeper_module, "time", clock)

    def fake_save(self, step):  # stands in for Keeper._save: 2 s a save
        saved.append(step)
        clock.now += 2.0
        self.saved_at, self.save_s = clock.now, 2.0

    monkeypatch.setattr(checkpoint.Keeper, "_save", fake_save)
    parallel.init_distributed()
    lm = AutoModelForCausalLM.from_pretrained(tiny_model)

    def make(**fields):
        return checkpoint.Keeper(CheckpointConfig(**fields), tmp_path, lm, None, tiny_model, last_step=1000)

    yield make, clock, saved
    parallel.shutdown()


def _run(k, clock, steps, step_s):
    for step in range(1, steps + 1):
        clock.now += step_s
        k.after_step(step, None)


def test_the_default_saves_a_minute_apart_and_at_the_last_step(keeper):
    make, clock, saved = keeper
    k = make()  # every = 0, budget = 0.02, min_interval_s = 60
    k.last_step = 200
    clock.now += 500.0  # the nodes' start-up: not counted
    _run(k, clock, 200, step_s=1.0)
    # the first step starts the clock; 60 s of steps later the first save (2 s); then 2 s / 0.02 = 100 s apart
    assert saved == [61, 161, 200]


def test_a_slow_save_waits_its_duration_over_the_budget(keeper):
    make, clock, saved = keeper
    k = make(min_interval_s=10.0, budget=0.1)  # 2 s a save: at most 10% of the time, 20 s apart
    k.last_step = 100
    _run(k, clock, 100, step_s=1.0)
    assert saved == [11, 31, 51, 71, 91, 100]
    spent = 2.0 * len(saved)
    assert spent / (100 * 1.0 + spent) <= 0.1 + 2.0 / 100  # within the budget, but for the last step's


def test_every_n_steps_and_budget_0_turn_the_clock_off(keeper):
    make, clock, saved = keeper
    k = make(every=30)
    k.last_step = 100
    _run(k, clock, 100, step_s=5.0)
    assert saved == [30, 60, 90, 100]
    saved.clear()
    k = make(budget=0.0)
    k.last_step = 100
    _run(k, clock, 100, step_s=5.0)
    assert saved == []  # no checkpoints at all, not even the last
