"""`streamrl run`'s closing line reads around a step that dynamic sampling left without samples (no reward)."""

from streamrl.ops.run import summary


def test_a_step_without_reward_statistics_is_passed_over():
    records = [{"reward/mean": 0.1, "completion_tokens": 10}, {"completion_tokens": 0}, {"reward/mean": 0.5}]
    assert summary(records, 10.0) == (
        "3 steps in 10 s; mean reward 0.100 (first 1 steps) -> 0.500 (last 1); 10 completion tokens trained, "
        "1 tokens/s overall"
    )


def test_the_tokens_of_skipped_steps_are_not_counted_as_trained():
    # step 2 took no update (zero reward variance): its 7 completion tokens trained nothing
    records = [
        {"reward/mean": 0.5, "completion_tokens": 10, "skipped": 0.0},
        {"reward/mean": 1.0, "completion_tokens": 7, "skipped": 1.0},
    ]
    assert summary(records, 10.0) == (
        "2 steps (1 skipped: no update) in 10 s; mean reward 0.500 (first 1 steps) -> 1.000 (last 1); "
        "10 completion tokens trained, 1 tokens/s overall"
    )
