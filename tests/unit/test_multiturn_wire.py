"""Multi-turn trajectories on the wire and in the learner's batch: the loss mask (1 model, 0 environment)."""

import msgspec
import pytest

from streamrl.engine import messages as m
from streamrl.engine.config import LossConfig
from streamrl.learner.batching import pack
from streamrl.learner.losses import local_normalizer


def episode(**overrides) -> m.Trajectory:
    # prompt [1 2] | model turn [10 11] | environment [20 21] | model turn [12]
    fields = dict(
        sample_id="g:0",
        group_id="g",
        node_id="n",
        seq=0,
        prompt_ids=[1, 2],
        completion_ids=[10, 11, 20, 21, 12],
        behavior_logprobs=[-0.5, -0.25, 0.0, 0.0, -2.0],
        reward=1.0,
        policy_version=3,
        token_versions=[3, 3, 3, 3, 4],  # a weight update between the turns; env tokens repeat the turn before
        loss_mask=[1, 1, 0, 0, 1],
    )
    fields.update(overrides)
    return m.Trajectory(**fields)


def test_loss_mask_round_trips_and_counts_model_tokens_only():
    traj = episode()
    back = m.decode_trajectory(m.encode(traj))
    assert back == traj and back.loss_mask == [1, 1, 0, 0, 1]
    assert back.model_tokens == 3 and back.min_version == 3


def test_a_single_turn_frame_is_unchanged_by_the_new_field():
    single = episode(
        completion_ids=[10, 11], behavior_logprobs=[-0.5, -0.25], token_versions=[], loss_mask=[], policy_version=3
    )
    fields = msgspec.to_builtins(single)
    # the mask, the episode counts (turns, tool calls) and reward_error are the last fields: a frame from
    # before them decodes with their defaults
    first_new = m.Trajectory.__struct_fields__.index("loss_mask")
    assert fields[first_new:] == [[], 0, 0, 0, 0, ""]
    for old in (fields[:first_new], fields[: first_new + 1]):
        assert m.decode_trajectory(msgspec.msgpack.encode(old)) == single and single.model_tokens == 2


@pytest.mark.parametrize(
    "mask",
    [
        [1, 1, 0, 0],  # one short
        [1, 1, 0, 0, 2],  # not 0/1
        [0, 1, 0, 0, 1],  # starts with an environment token
    ],
)
def test_a_bad_loss_mask_is_a_decode_error(mask):
    fields = msgspec.to_builtins(episode())
    fields[m.Trajectory.__struct_fields__.index("loss_mask")] = mask
    with pytest.raises(m.DecodeError, match="loss_mask"):
        m.decode_trajectory(msgspec.msgpack.encode(fields))


def test_pack_trains_only_on_model_tokens():
    (mb,) = pack([episode(behavior_logprobs=[-0.5, -0.25, -9.0, -9.0, -2.0])], [2.0], token_budget=16)
    # [1 2 | 10 11 20 21 12] reads [1 2 10 11 20 21], predicts [2 10 11 20 21 12];
    # position 0 predicts a prompt token, 1-2 the first turn, 3-4 the environment's, 5 the second turn
    assert mb.targets.tolist() == [2, 10, 11, 20, 21, 12]
    assert mb.loss_mask.tolist() == [False, True, True, False, False, True]
    # a sender's logprob on an environment token (-9 here, 0.0 by the wire's contract) never reaches the loss
    assert mb.behavior_logprobs.tolist() == [0.0, -0.5, -0.25, 0.0, 0.0, -2.0]
    assert mb.versions.tolist() == [-1, 3, 3, -1, -1, 4]
    assert mb.advantages.tolist() == [0.0, 2.0, 2.0, 0.0, 0.0, 2.0]
    assert mb.loss_tokens == 3 == mb.num_loss_tokens and mb.loss_sequences == 1
    for aggregation, counted in (("token", mb.loss_tokens), ("sequence", mb.loss_sequences)):
        assert counted == float(local_normalizer(mb.loss_mask, mb.seq_ids, LossConfig(aggregation=aggregation)))
