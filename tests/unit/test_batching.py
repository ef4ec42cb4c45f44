import random

import pytest

from streamrl.engine.messages import Trajectory
from streamrl.learner.batching import loss_free, pack, pack_for_ranks, plan, split_by_tokens


def traj(sid, prompt, completion, logprobs, version=0, token_versions=()):
    return Trajectory(
        sample_id=sid,
        group_id="g",
        node_id="n",
        seq=0,
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        behavior_logprobs=list(logprobs),
        reward=1.0,
        policy_version=version,
        token_versions=list(token_versions),
    )


A = traj("a", [1, 2, 3], [4, 5], [-0.1, -0.2], version=3)
B = traj("b", [7], [8, 9, 10], [-1.0, -2.0, -3.0], version=5, token_versions=[5, 5, 6])


def test_pack_aligns_completion_tokens_with_their_logprobs():
    (mb,) = pack([A, B], [1.5, -0.5], token_budget=7)
    # A = [1 2 3 | 4 5] reads [1 2 3 4], predicts [2 3 4 5]; positions 2, 3 predict the completion
    # B = [7 | 8 9 10] reads [7 8 9], predicts [8 9 10]; all three positions predict the completion
    assert mb.input_ids.tolist() == [1, 2, 3, 4, 7, 8, 9]
    assert mb.targets.tolist() == [2, 3, 4, 5, 8, 9, 10]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert mb.loss_mask.tolist() == [False, False, True, True, True, True, True]
    assert mb.behavior_logprobs.tolist() == pytest.approx([0, 0, -0.1, -0.2, -1, -2, -3])
    assert mb.advantages.tolist() == [0, 0, 1.5, 1.5, -0.5, -0.5, -0.5]
    assert mb.versions.tolist() == [-1, -1, 3, 3, 5, 5, 6]
    assert mb.seq_ids.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert mb.cu_seqlens.tolist() == [0, 4, 7] and mb.max_seqlen == 4
    assert mb.sample_ids == ["a", "b"] and mb.num_loss_tokens == 5
    assert mb.loss_tokens == 5 and mb.loss_sequences == 2  # counted from the lists, agreeing with the mask


def test_host_counts_agree_with_the_mask_when_padded():
    from streamrl.engine.config import LossConfig
    from streamrl.learner.losses import local_normalizer

    (mb,) = pack([A, B], [1.0, 1.0], token_budget=12, pad_to_budget=True)
    for aggregation, counted in (("token", mb.loss_tokens), ("sequence", mb.loss_sequences)):
        assert counted == float(local_normalizer(mb.loss_mask, mb.seq_ids, LossConfig(aggregation=aggregation)))


def test_budget_splits_into_micro_batches():
    # costs 4 and 3 do not share a budget of 5
    batches = pack([A, B], [1.0, 1.0], token_budget=5)
    assert [mb.sample_ids for mb in batches] == [["a"], ["b"]]


def test_overlong_sequence_names_the_config_field():
    with pytest.raises(ValueError, match="learner.micro_batch_tokens = 3"):
        pack([A], [1.0], token_budget=3)


def test_sample_without_completion_is_skipped():
    empty = traj("e", [1, 2], [], [])
    batches = pack([empty, B], [1.0, 2.0], token_budget=16)
    assert [mb.sample_ids for mb in batches] == [["b"]]


def test_plan_respects_budget_and_keeps_every_index():
    rng = random.Random(0)
    costs = [rng.randint(1, 50) for _ in range(200)]
    bins = plan(costs, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(costs[i] for i in b) <= 64 for b in bins)
    # first-fit decreasing stays within 11/9 OPT + 1 of the lower bound
    assert len(bins) <= 11 / 9 * (sum(costs) / 64) + 2


def test_pad_to_budget_adds_one_loss_free_sequence():
    (mb,) = pack([A, B], [1.5, -0.5], token_budget=10, pad_to_budget=True)
    # 4 + 3 positions used, 3 of padding as a third sequence restarting its positions
    assert mb.num_tokens == 10 and mb.num_loss_tokens == 5
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert mb.loss_mask[7:].tolist() == [False] * 3 and mb.cu_seqlens.tolist() == [0, 4, 7, 10]
    assert mb.seq_ids[7:].tolist() == [2, 2, 2] and mb.sample_ids == ["a", "b"]


def test_ranks_get_shares_balanced_by_tokens_within_one_sample():
    # costs 9 7 5 4 3 2 over 2 ranks, longest first to the lighter rank (ties: the lower rank):
    # 9 -> r0 (0 = 0); 7 -> r1 (0 < 9); 5 -> r1 (7 < 9, r1 = 12); 4 -> r0 (9 < 12, r0 = 13);
    # 3 -> r1 (12 < 13, r1 = 15); 2 -> r0 (13 < 15, r0 = 15): r0 holds 9 4 2, r1 holds 7 5 3
    shares = split_by_tokens([9, 7, 5, 4, 3, 2], 2)
    assert shares == [[0, 3, 5], [1, 2, 4]]


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_random_batches_split_within_the_largest_sample(ranks):
    rng = random.Random(ranks)
    for _ in range(50):
        costs = [rng.randint(1, 400) for _ in range(rng.randint(ranks, 64))]
        shares = split_by_tokens(costs, ranks)
        assert sorted(i for share in shares for i in share) == list(range(len(costs)))
        loads = [sum(costs[i] for i in share) for share in shares]
        assert max(loads) - min(loads) <= max(costs)


def test_pack_for_ranks_packs_each_share():
    trajs = [traj(f"s{i}", [1] * (i + 2), [2] * (i + 1), [-0.5] * (i + 1)) for i in range(6)]
    per_rank = pack_for_ranks(trajs, [float(i) for i in range(6)], ranks=2, token_budget=64)
    ids = [sorted(sid for mb in mbs for sid in mb.sample_ids) for mbs in per_rank]
    assert sorted(ids[0] + ids[1]) == [f"s{i}" for i in range(6)] and set(ids[0]).isdisjoint(ids[1])
    positions = [sum(mb.num_tokens for mb in mbs) for mbs in per_rank]
    assert abs(positions[0] - positions[1]) <= max(2 * i + 2 for i in range(6))


def test_pad_multiple_pads_each_micro_batch_to_a_bucket_not_the_budget():
    # A costs 3 + 2 - 1 = 4 positions, B costs 1 + 3 - 1 = 3: one bin of 7, padded up to 8 (a multiple of 4)
    (mb,) = pack([A, B], [1.0, 1.0], token_budget=64, pad_multiple=4)
    assert mb.num_tokens == 8 and mb.loss_tokens == 5 and mb.loss_mask[7].item() is False
    (full,) = pack([A, B], [1.0, 1.0], token_budget=64, pad_to_budget=True)
    assert full.num_tokens == 64


def test_loss_free_micro_batch_has_the_asked_shape_and_no_loss_token():
    mb = loss_free(100, 3)
    assert mb.num_tokens == 100 and mb.cu_seqlens.tolist() == [0, 33, 66, 100] and mb.max_seqlen == 34
    assert mb.num_loss_tokens == 0 and mb.loss_tokens == 0 and mb.loss_sequences == 0
    assert mb.position_ids[33].item() == 0 and mb.seq_ids.tolist() == [0] * 33 + [1] * 33 + [2] * 34
    with pytest.raises(ValueError, match="4 sequences cannot cut 3 positions"):
        loss_free(3, 4)
