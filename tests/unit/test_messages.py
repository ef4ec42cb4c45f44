import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.engine import messages as m


def _trajectory(**overrides) -> m.Trajectory:
    fields = dict(
        sample_id="g1:0",
        group_id="g1",
        node_id="node-a",
        seq=7,
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5],
        behavior_logprobs=[-0.25, -1.5],
        reward=0.5,
        policy_version=3,
        token_versions=[3, 4],
        finish_reason="stop",
        group_size=4,
        timings=m.Timings(submitted=1.0, finished=2.0, rewarded=2.5),
    )
    fields.update(overrides)
    return m.Trajectory(**fields)


CONTROL = [
    m.Register(node_id="n", host="h", device="cuda", backend="hf"),
    m.Welcome(
        node_id="n", trajectory_addr="tcp://127.0.0.1:5000", redis_url="redis://x", run_name="r", policy_version=2
    ),
    m.Heartbeat(node_id="n", policy_version=1, in_flight=3, tokens_generated=99),
    m.WeightsReady(
        version=5,
        store_host="127.0.0.1",
        store_port=1234,
        group_prefix="n/5",
        world_size=2,
        timeout_s=30.0,
        buckets=[
            m.BucketSpec(
                dtype="bfloat16",
                numel=6,
                tensors=[
                    m.TensorSpec(name="a", shape=[2, 2], offset=0, numel=4),
                    m.TensorSpec(name="b", shape=[2], offset=4, numel=2),
                ],
            )
        ],
    ),
    m.WeightsApplied(node_id="n", version=5, seconds=0.25, error=""),
    m.Stop(reason="done"),
    m.Goodbye(node_id="n", reason="sigterm"),
]


def test_trajectory_round_trips():
    t = _trajectory()
    assert m.decode_trajectory(m.encode(t)) == t


def test_trajectory_reward_none_round_trips():
    t = _trajectory(reward=None, token_versions=[])
    back = m.decode_trajectory(m.encode(t))
    assert back.reward is None and back.min_version == 3


@pytest.mark.parametrize("message", CONTROL, ids=lambda msg: type(msg).__name__)
def test_control_round_trips_with_its_type(message):
    back = m.decode_control(m.encode(message))
    assert type(back) is type(message) and back == message


def test_min_version_is_the_oldest_token():
    assert _trajectory(token_versions=[4, 3]).min_version == 3
    assert _trajectory(token_versions=[]).min_version == 3


@pytest.mark.parametrize(
    "bad",
    [
        dict(behavior_logprobs=[-0.1]),  # one logprob for two tokens
        dict(token_versions=[1]),
        dict(prompt_ids=[]),
        dict(seq=-1),
    ],
)
def test_invariants_broken_on_the_wire_raise_decode_error(bad):
    fields = msgspec.to_builtins(_trajectory())
    names = m.Trajectory.__struct_fields__
    for key, value in bad.items():
        fields[names.index(key)] = value
    with pytest.raises(m.DecodeError):
        m.decode_trajectory(msgspec.msgpack.encode(fields))


def test_a_control_frame_is_not_a_trajectory():
    with pytest.raises(m.DecodeError):
        m.decode_trajectory(m.encode(m.Stop(reason="x")))
    with pytest.raises(m.DecodeError):
        m.decode_control(m.encode(_trajectory()))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_decode_error(frame):
    for decode in (m.decode_trajectory, m.decode_control):
        try:
            decode(frame)
        except m.DecodeError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.data())
def test_truncated_frames_raise_decode_error(cut, data):
    for frame in (m.encode(_trajectory()), m.encode(data.draw(st.sampled_from(CONTROL)))):
        cut_at = cut % len(frame)
        decode = m.decode_trajectory if frame == m.encode(_trajectory()) else m.decode_control
        with pytest.raises(m.DecodeError):
            decode(frame[:cut_at])
