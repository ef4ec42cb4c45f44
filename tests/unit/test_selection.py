"""What a step trains of its groups (learner/selection.py), against numbers worked by hand: the soft overlong
penalty, the zero-variance test, dynamic sampling's refill bound and truncated completions masked.
(tests/unit/test_admission.py runs the same through a real ledger and socket.)"""

import pytest

from streamrl.engine.config import LossConfig
from streamrl.engine.messages import Trajectory
from streamrl.learner.batching import pack
from streamrl.learner.selection import is_truncated, overlong_penalty, select, zero_variance


def group(gid: str, rewards, lengths=None, finish=None) -> list[Trajectory]:
    n = len(rewards)
    lengths, finish = lengths or [3] * n, finish or ["stop"] * n
    return [
        Trajectory(sample_id=f"{gid}:{i}", group_id=gid, node_id="n", seq=i, prompt_ids=[3, 4],
                   completion_ids=list(range(10, 10 + lengths[i])), behavior_logprobs=[-1.0] * lengths[i],
                   reward=rewards[i], policy_version=0, finish_reason=finish[i], group_size=n)
        for i in range(n)
    ]  # fmt: skip


class FakeIntake:
    """Stands in for the intake and the ledger: `take` over a queue of groups (in admission order), `drop`
    recording what the ledger was told."""

    def __init__(self, groups):
        self.queue, self.dropped, self.asked = list(groups), [], []

    def take(self, n, holding):
        self.asked.append((n, set(holding)))
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def drop(self, ids, reason):
        self.dropped.append((reason, list(ids)))


def test_overlong_penalty_is_dapos_linear_ramp():
    # limit 20, buffer 4: free up to 16 tokens, then -1/4 per token down to -1 at 20 (penalty factor 1)
    assert [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(19, 20, 4, 0.5) == -0.375  # (19 - 16) / 4 x 0.5
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0  # buffer 0: off


def test_zero_variance_is_all_equal_or_a_std_below_the_threshold():
    assert zero_variance([1.0, 1.0, 1.0 + 1e-7]) and zero_variance([0.3])
    assert not zero_variance([0.0, 0.1])
    # population std of [0, 0.1] is 0.05: zero variance at a threshold of 0.05, not at 0.04
    assert zero_variance([0.0, 0.1], 0.05) and not zero_variance([0.0, 0.1], 0.04)


def test_truncated_means_cut_by_a_length_limit():
    reasons = ("length", "stop", "max_total_tokens", "max_model_len", "max_turns", "done")
    assert [is_truncated(group("g", [0.0], finish=[f])[0]) for f in reasons] == [True, False, True, True, False, False]


def test_dynamic_sampling_drops_flat_groups_and_takes_the_next_ones_in_their_place():
    flat_a, good_b, flat_c, good_d, good_e = (
        group("a", [1.0, 1.0]), group("b", [0.0, 1.0]), group("c", [0.0, 0.0]), group("d", [1.0, 0.0]),
        group("e", [0.5, 0.0]),
    )  # fmt: skip
    source = FakeIntake([flat_a, good_b, flat_c, good_d, good_e])
    out = select(source.take, source.drop, 2, LossConfig(dynamic_sampling=True), limit=32)
    # two taken (a flat), one more (c flat), one more (d): the step has b and d, 4 samples
    assert [g[0].group_id for g in out.groups] == ["b", "d"] and len(out.train) == 4
    assert source.dropped == [("zero_variance", ["a:0", "a:1"]), ("zero_variance", ["c:0", "c:1"])]
    assert source.asked == [(2, set()), (1, {"b"}), (1, {"b"})]  # a refill passes over the groups held
    assert (out.examined, out.zero_variance, out.refilled, out.unfilled) == (4, 2, 2, False)
    m = out.metrics(2)
    assert m["filter/zero_variance_rate"] == 0.5 and m["filter/unfilled"] == 0.0
    # group_std advantages of [0, 1]: (r - 0.5) / (std 0.7071 + 1e-6) = -/+0.707106
    assert out.advantages == pytest.approx([-0.707106, 0.707106, 0.707106, -0.707106], abs=1e-5)


def test_a_step_that_cannot_fill_within_the_bound_trains_what_it_has(caplog):
    from streamrl.learner.selection import warn_unfilled

    source = FakeIntake([group("a", [0.0, 1.0])] + [group(f"f{i}", [1.0, 1.0]) for i in range(10)])
    cfg = LossConfig(dynamic_sampling=True, refill_limit=1)
    out = select(source.take, source.drop, 3, cfg, limit=32)
    # 3 taken (2 flat), then at most 1 x 3 replacements: 2, then 1 (both flat); 6 examined, 1 kept
    assert [g[0].group_id for g in out.groups] == ["a"] and out.unfilled
    assert (out.examined, out.zero_variance, out.refilled) == (6, 5, 3)
    assert out.metrics(3)["filter/unfilled"] == 1.0
    with caplog.at_level("WARNING", logger="streamrl.learner"):
        warn_unfilled(7, out, 3, cfg)
    assert "step 7: 5 of 6 groups examined had zero reward variance" in caplog.text
    assert "loss.refill_limit = 1" in caplog.text and "trains 1 groups instead of 3" in caplog.text


def test_without_dynamic_sampling_flat_groups_stay_and_are_counted():
    source = FakeIntake([group("a", [1.0, 1.0]), group("b", [0.0, 1.0])])
    out = select(source.take, source.drop, 2, LossConfig(), limit=32)
    assert len(out.groups) == 2 and source.dropped == [] and out.advantages[:2] == [0.0, 0.0]
    assert out.metrics(2)["filter/zero_variance_rate"] == 0.5


def test_the_overlong_penalty_shapes_the_rewards_the_advantages_and_the_filter_see():
    # limit 8, buffer 4: lengths 4 and 8 -> penalties 0 and -1; equal task rewards now differ
    source = FakeIntake([group("a", [1.0, 1.0], lengths=[4, 8])])
    out = select(source.take, source.drop, 1, LossConfig(dynamic_sampling=True, overlong_buffer=4), limit=8)
    assert out.rewards == [[1.0, 0.0]] and out.zero_variance == 0
    assert out.advantages == pytest.approx([0.707106, -0.707106], abs=1e-5)
    assert out.metrics(1)["reward/overlong_penalty_mean"] == -0.5


def test_a_masked_truncated_completion_counts_in_its_baseline_and_contributes_no_loss():
    # rewards [1, 0, 0, 0], the first cut at max_tokens: advantages over all four, (r - 0.25) / 0.5 = [1.5, -0.5 ...]
    g = group("a", [1.0, 0.0, 0.0, 0.0], finish=["length", "stop", "stop", "stop"])
    source = FakeIntake([g])
    out = select(source.take, source.drop, 1, LossConfig(mask_truncated=True), limit=32)
    assert [t.sample_id for t in out.train] == ["a:1", "a:2", "a:3"] and out.masked == ["a:0"]
    assert out.advantages == pytest.approx([-0.5, -0.5, -0.5], abs=1e-5)  # the baseline kept the cut one
    assert source.dropped == []  # dropped as truncated when the step commits, with the rest of its group
    assert out.metrics(1)["filter/truncated_masked"] == 1.0
    # its tokens are in no micro-batch: no loss term and not in the normaliser (3 samples x 3 tokens)
    (mb,) = pack(out.train, out.advantages, token_budget=64)
    assert mb.sample_ids == ["a:1", "a:2", "a:3"] and mb.loss_tokens == 9
    unmasked = select(FakeIntake([g]).take, lambda *_: None, 1, LossConfig(), limit=32)
    assert len(unmasked.train) == 4
