"""GPU placement: explicit, never two roles on one GPU unless asked, refused at start naming the fields."""

import pytest

from streamrl.engine.config import ConfigError, build
from streamrl.engine.placement import plan


def _cfg(*sets):
    return build({}, list(sets))


def test_automatic_split_gives_the_learner_the_first_gpus_and_nodes_the_rest():
    p = plan(_cfg("learner.ranks=1"), gpus=2, nodes=2)
    assert p.learner == [0] and [p.node_gpu(i) for i in range(3)] == [1, 1, 1]
    assert p.describe(2) == (
        "placement: learner rank 0 → GPU 0; node-0 → GPU 1 (weights by NCCL), node-1 → GPU 1 (weights by NCCL)"
    )
    p = plan(_cfg("learner.ranks=2"), gpus=4, nodes=3)
    assert p.learner == [0, 1] and [p.node_gpu(i) for i in range(3)] == [2, 3, 2]


def test_explicit_gpus_are_honoured():
    p = plan(_cfg("learner.ranks=2", "learner.gpus=[3, 1]", "rollout.gpus=[0]"), gpus=4, nodes=2)
    assert p.learner == [3, 1] and p.nodes == [0]


@pytest.mark.parametrize(
    "sets, gpus, message",
    [
        (["learner.ranks=3"], 2, "learner.ranks = 3 but this host has 2 GPU"),
        (["learner.gpus=[0, 0]"], 2, r"learner.gpus = \[0, 0\] gives a GPU twice"),
        (["learner.gpus=[2]"], 2, r"learner.gpus = \[2\]: this host has GPUs 0..1, not \[2\]"),
        (["learner.ranks=2", "learner.gpus=[0]"], 2, "lists 1 GPU.*learner.ranks = 2"),
        (["rollout.gpus=[0]"], 2, r"GPU\(s\) \[0\] are in both learner.gpus and rollout.gpus.*share_learner_gpus"),
        (["learner.ranks=2"], 2, "rollout nodes have none left.*share_learner_gpus"),
        ([], 0, "no CUDA device"),
    ],
)
def test_placements_that_cannot_be_are_refused_naming_the_fields(sets, gpus, message):
    with pytest.raises(ConfigError, match=message):
        plan(_cfg(*sets), gpus=gpus, nodes=1)


def test_sharing_is_allowed_when_asked():
    p = plan(_cfg("learner.ranks=2", "rollout.share_learner_gpus=true"), gpus=2, nodes=1)
    assert p.learner == [0, 1] and p.nodes == [0, 1]
    assert plan(_cfg("learner.ranks=2"), gpus=2, nodes=0).learner == [0, 1]  # learner alone: no nodes to place


def test_the_placement_line_names_each_nodes_weights_path():
    one = plan(_cfg("rollout.share_learner_gpus=true"), gpus=1, nodes=1)
    assert (
        one.describe(1) == "placement: learner rank 0 → GPU 0; node-0 → GPU 0 (the learner's GPU; weights by CUDA IPC)"
    )
    two = plan(_cfg("learner.ranks=2", "rollout.share_learner_gpus=true"), gpus=2, nodes=2)
    # node-1 shares learner rank 1's GPU; its weights come from rank 0 (GPU 0): a broadcast between two GPUs
    assert two.describe(2).endswith("node-0 → GPU 0 (the learner's GPU; weights by CUDA IPC), "
                                    "node-1 → GPU 1 (the learner's GPU; weights by NCCL)")  # fmt: skip
    assert "(the learner's GPU; weights by gloo)" in one.describe(1, weights_backend="gloo")


def test_vllm_nodes_that_share_a_gpu_each_take_an_equal_share_of_what_the_ledger_admits(tmp_path):
    from streamrl.engine.placement import Placement, shared_gpu_share
    from streamrl.ops.launcher import Launcher

    cfg = _cfg("rollout.backend='vllm'", "run.device='cuda'", "learner.groups_per_step=60",
               "rollout.share_learner_gpus=true", "ledger.max_staleness=1")  # fmt: skip
    one_gpu = plan(cfg, gpus=1, nodes=3)
    assert [shared_gpu_share(cfg, one_gpu, 2, i) for i in range(2)] == [
        ["--set", "rollout.max_concurrent_groups=60"]
    ] * 2
    assert shared_gpu_share(cfg, one_gpu, 3, 2) == ["--set", "rollout.max_concurrent_groups=40"]
    assert shared_gpu_share(cfg, one_gpu, 1, 0) == []  # alone on its GPU: every admitted group, as before
    assert shared_gpu_share(cfg, plan(cfg, gpus=3, nodes=2), 2, 0) == []  # GPUs 1 and 2: one node each
    hf = _cfg("rollout.backend='hf'", "run.device='cuda'", "rollout.share_learner_gpus=true")
    assert shared_gpu_share(hf, plan(hf, gpus=1, nodes=2), 2, 0) == []  # hf fills its static rows, shared or not
    given = _cfg("rollout.backend='vllm'", "run.device='cuda'", "rollout.max_concurrent_groups=16")
    assert shared_gpu_share(given, Placement(learner=[0], nodes=[0]), 2, 0) == []  # the user's number stands

    launcher = Launcher(
        _cfg("rollout.backend='vllm'", "run.device='cuda'", "learner.groups_per_step=6", f"run.dir='{tmp_path}'")
    )
    launcher.placement, launcher._planned_nodes = Placement(learner=[0], nodes=[0]), 2
    command = launcher.node_process("node-1", 1)
    assert command[command.index("--node-id") + 1] == "node-1" and command[-2:] == [
        "--set",
        "rollout.max_concurrent_groups=6",
    ]
