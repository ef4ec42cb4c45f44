"""`streamrl run`'s closing line reads around a step that dynamic sampling left without samples (no reward), and
gives trained tokens/s as the live row does (ops/progress.py `trained_rate`)."""

from streamrl.ops.run import summary


def test_a_step_without_reward_statistics_is_passed_over():
    records = [
        {"reward/mean": 0.1, "completion_tokens": 10, "time/wait_s": 1.5, "time/train_s": 2.0},
        {"completion_tokens": 0, "time/wait_s": 2.0},
        {"reward/mean": 0.5, "time/wait_s": 1.0},
    ]
    # 10 tokens / (2.0 + 2.0 + 1.0) s = 2 tokens/s (the first step's wait is the nodes' start: left out)
    assert summary(records, 10.0) == (
        "3 steps in 10 s; mean reward 0.100 (first 1 steps) -> 0.500 (last 1); "
        "trained 2 tokens/s (10 trained tokens / 5.0 s of 3 steps); 10 s wall"
    )


def test_the_tokens_of_skipped_steps_are_not_counted_as_trained():
    # step 2 took no update (zero reward variance): its 7 completion tokens trained nothing, its 3 s were spent
    records = [
        {"reward/mean": 0.5, "completion_tokens": 12, "skipped": 0.0, "time/wait_s": 0.5, "time/train_s": 1.0},
        {"reward/mean": 1.0, "completion_tokens": 7, "skipped": 1.0, "time/wait_s": 2.0, "time/train_s": 1.0},
    ]
    # 12 tokens / (1.0 + 3.0) s = 3 tokens/s
    assert summary(records, 10.0) == (
        "2 steps (1 skipped: no update) in 10 s; mean reward 0.500 (first 1 steps) -> 1.000 (last 1); "
        "trained 3 tokens/s (12 trained tokens / 4.0 s of 2 steps, 1 skipped); 10 s wall"
    )
