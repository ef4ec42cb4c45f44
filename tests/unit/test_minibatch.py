"""A rank's micro-batches as mini-batches of whole sequences, balanced by positions (learner/minibatch.py)."""

import torch

from streamrl.engine.messages import Trajectory
from streamrl.learner.batching import pack
from streamrl.learner.minibatch import cut_points, split_updates


def traj(i: int, prompt: int, completion: int) -> Trajectory:
    return Trajectory(
        sample_id=f"s{i}",
        group_id="g",
        node_id="n",
        seq=i,
        prompt_ids=[3] * prompt,
        completion_ids=[7 + i] * completion,
        behavior_logprobs=[-float(i)] * completion,
        reward=0.0,
        policy_version=i,
    )


def test_cut_points_by_hand():
    # costs 4, 4, 2, 6 (total 16), 2 parts: prefix sums 0 4 8 10 16, target 8 -> cut after the second
    assert cut_points([4, 4, 2, 6], 2) == [0, 2, 4]
    # 3 parts, targets 5.33 and 10.67: nearest prefixes 4 (|1.33| < |2.67| for 8) and 10 -> [0, 1, 3, 4]
    assert cut_points([4, 4, 2, 6], 3) == [0, 1, 3, 4]
    # [9, 1] in 2: target 5 is nearest prefix 9 (the cut after the first), and no run may be empty anyway
    assert cut_points([9, 1], 2) == [0, 1, 2]
    # never an empty run while there are enough items: [10, 1, 1] in 3 runs is one each
    assert cut_points([10, 1, 1], 3) == [0, 1, 2, 3]
    # fewer items than runs: targets 3.33 and 6.67 are both nearest prefix 5, so the middle run is empty
    assert cut_points([5, 5], 3) == [0, 1, 1, 2]


def test_whole_micro_batches_are_dealt_longest_first_when_there_are_enough():
    # budget 8: sequences of 7, 7, 4, 3 positions make micro-batches of 7, 7 and 4+3 = 7 positions
    mbs = pack([traj(0, 4, 4), traj(1, 4, 4), traj(2, 2, 3), traj(3, 2, 2)], [1.0] * 4, token_budget=8)
    assert [mb.num_tokens for mb in mbs] == [7, 7, 7]
    minis = split_updates(mbs, 2)
    assert [[id(mb) for mb in mini] for mini in minis] == [[id(mbs[0]), id(mbs[2])], [id(mbs[1])]]
    assert split_updates(mbs, 1) == [mbs]


def test_one_micro_batch_is_sliced_at_sequence_boundaries():
    # positions 5, 4, 6, 3 (prompt + completion - 1); total 18, target 9: prefix 9 after two sequences
    trajs = [traj(0, 3, 3), traj(1, 2, 3), traj(2, 3, 4), traj(3, 2, 2)]
    (mb,) = pack(trajs, [1.0, 2.0, 3.0, 4.0], token_budget=64)
    first, second = split_updates([mb], 2)
    (a,), (b,) = first, second
    assert a.num_tokens == 9 and b.num_tokens == 9
    assert a.cu_seqlens.tolist() == [0, 5, 9] and b.cu_seqlens.tolist() == [0, 6, 9]
    assert a.seq_ids.tolist() == [0] * 5 + [1] * 4 and b.seq_ids.tolist() == [0] * 6 + [1] * 3
    assert a.max_seqlen == 5 and b.max_seqlen == 6
    # loss tokens = completion lengths: 3 + 3 and 4 + 2; every field is the original's rows
    assert (a.loss_tokens, a.loss_sequences, b.loss_tokens, b.loss_sequences) == (6, 2, 6, 2)
    assert a.sample_ids == ["s0", "s1"] and b.sample_ids == ["s2", "s3"]
    for name in ("input_ids", "targets", "loss_mask", "behavior_logprobs", "advantages", "versions", "position_ids"):
        assert torch.equal(torch.cat([getattr(a, name), getattr(b, name)]), getattr(mb, name)), name
    assert b.advantages[b.loss_mask].tolist() == [3.0] * 4 + [4.0] * 2


def test_a_run_across_two_micro_batches_takes_a_piece_of_each():
    # four sequences of 5 positions, budget 10: micro-batches [s0 s1] and [s2 s3]. 3 updates: targets 6.67 and
    # 13.33 of 20 against prefixes 0 5 10 15 20 -> cuts after s0 (5) and s2 (15): runs {s0}, {s1, s2}, {s3},
    # the middle one a piece of each micro-batch
    mbs = pack([traj(i, 3, 3) for i in range(4)], [0.0] * 4, token_budget=10)
    assert [mb.sample_ids for mb in mbs] == [["s0", "s1"], ["s2", "s3"]]
    minis = split_updates(mbs, 3)
    assert [[mb.sample_ids for mb in mini] for mini in minis] == [[["s0"]], [["s1"], ["s2"]], [["s3"]]]
    assert [[mb.num_tokens for mb in mini] for mini in minis] == [[5], [5, 5], [5]]
    assert minis[1][1].versions[minis[1][1].loss_mask].tolist() == [2, 2, 2]  # s2's rows, sampled by version 2
