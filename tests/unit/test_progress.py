"""ops/progress.py: the one definition of trained tokens/s (the live row, the closing line), and the plain lines
`streamrl run` prints where there is no terminal."""

from __future__ import annotations

from rich.console import Console

from streamrl.ops.live import live_table
from streamrl.ops.phases import RoleState, Snapshot
from streamrl.ops.progress import PlainProgress, trained_rate
from streamrl.ops.run import summary

# step 2 took no update: its 500 tokens trained nothing, its 2 s were spent all the same; step 1's 60 s wait is the
# nodes' start
RECORDS = [
    {"step": 1, "completion_tokens": 300, "skipped": 0.0, "time/wait_s": 60.0, "time/train_s": 1.0,
     "time/idle_fraction": 0.25, "reward/mean": 0.5, "reward/std": 0.1, "nodes": 2, "staleness_mean": 0.5},
    {"step": 2, "completion_tokens": 500, "skipped": 1.0, "time/wait_s": 1.5, "time/train_s": 0.5},
    {"step": 3, "completion_tokens": 100, "skipped": 0.0, "time/train_s": 0.5, "time/push_s": 0.25,
     "time/checkpoint_s": 0.25},
]  # fmt: skip


def test_trained_tokens_per_second_counts_updated_steps_over_every_steps_time():
    rate = trained_rate(RECORDS)
    # (300 + 100) tokens / (1.0 + 2.0 + 1.0) s = 100 tokens/s; step 1's wait left out, time/idle_fraction is no lap
    assert (rate.tokens, rate.seconds, rate.steps, rate.skipped) == (400, 4.0, 3, 1) and rate.per_s == 100.0
    assert str(rate) == "100 tokens/s (400 trained tokens / 4.0 s of 3 steps, 1 skipped)"
    assert trained_rate([]).per_s == 0.0
    # a resumed run: steps 1-3, then 3 again (the checkpoint was at step 2); the second launch's first wait is left
    # out too: (400 + 50) tokens / (4.0 + 0.5) s = 100 tokens/s
    again = {"step": 3, "completion_tokens": 50, "time/wait_s": 30.0, "time/train_s": 0.5}
    assert str(trained_rate([*RECORDS, again])) == "100 tokens/s (450 trained tokens / 4.5 s of 4 steps, 1 skipped)"


def render(renderable) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def snapshot(phase: str = "training") -> Snapshot:
    return Snapshot(phase, RoleState("learner", "training"), [RoleState("node-0", "generating", "policy v2")])


def test_the_live_row_and_the_closing_line_agree_on_a_run_with_skipped_steps():
    said = str(trained_rate(RECORDS))
    table = render(live_table(snapshot(), RECORDS, steps=3, elapsed_s=9.0))
    row = next(line for line in table.splitlines() if "tokens/s (trained)" in line)
    assert said in row
    assert f"trained {said}" in summary(RECORDS, 9.0)  # the wall time (9 s) is said apart, not divided by


def test_without_a_terminal_a_plain_line_per_step_and_the_phase_as_it_changes():
    console = Console(record=True, width=200, force_terminal=False)
    with PlainProgress(console, every_s=3600) as out:
        out.update(live_table(snapshot("warming up the engines"), [], steps=3, elapsed_s=1.0))
        out.update(live_table(snapshot("warming up the engines"), [], steps=3, elapsed_s=2.0))  # nothing new
        out.update(live_table(snapshot(), RECORDS[:1], steps=3, elapsed_s=5.0))
        out.update(live_table(snapshot(), RECORDS, steps=3, elapsed_s=9.0))  # two steps in one poll: two lines
    lines = console.export_text().splitlines()
    assert lines[0] == "phase: warming up the engines (1 s)"
    assert lines[1].startswith("step 1/3  reward 0.500 ± 0.100  loss -  trained 300 tokens/s (300 trained tokens /")
    assert lines[1].endswith("staleness 0.50 (max -)  nodes 2  5 s") and lines[2] == "phase: training (5 s)"
    # after step 2: 300 tokens / (1.0 + 2.0) s = 100 tokens/s
    assert lines[3].startswith("step 2/3 (skipped: no update)  reward - ± -  loss -  trained 100 tokens/s (300 ")
    assert lines[4].startswith("step 3/3 ") and str(trained_rate(RECORDS)) in lines[4]
    assert "streamrl — step 3/3" in lines[5]  # the last frame's table, every role as it ended


def test_without_a_step_the_roles_are_said_every_few_seconds():
    console = Console(record=True, width=200, force_terminal=False)
    out = PlainProgress(console, every_s=0.0)
    out.update(live_table(snapshot("waiting for the first batch"), [], steps=3, elapsed_s=1.0))
    out.update(live_table(snapshot("waiting for the first batch"), [], steps=3, elapsed_s=31.0))
    lines = console.export_text().splitlines()
    assert lines == [
        "phase: waiting for the first batch (1 s)",
        "waiting for the first batch (31 s): learner: training; node-0: generating: policy v2",
    ]


def test_the_reward_kl_row_shows_the_coefficient_where_one_is_logged():
    logged = [*RECORDS[:2], {**RECORDS[2], "critic/reward_kl": 0.0123, "critic/reward_kl_coef": 0.0481}]
    row = next(line for line in render(live_table(snapshot(), logged, 3, 9.0)).splitlines() if "reward KL" in line)
    assert "1.23e-02 / 0.0481" in row
    assert "reward KL" not in render(live_table(snapshot(), RECORDS, 3, 9.0))  # no KL in the reward: no row
