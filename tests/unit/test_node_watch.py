"""`streamrl run` ends a run for lack of rollout nodes only when none of its own nodes is alive and the
learner's roster (every node it registered, whoever started it) has been empty for the wait (the heartbeat
TTL). The launcher's children and the roster are stood in for; tests/integration/faults/test_run_replacement.py
drives the real processes."""

import pathlib

import pytest

from streamrl.engine.config import build
from streamrl.ops.phases import RoleState
from streamrl.ops.run import _NodeWatch


class FakeChild:
    """Stands in for a launcher's `Child`: alive or not, and where its log is."""

    def __init__(self, alive: bool):
        self.alive, self.log_path = alive, pathlib.Path("/runs/x/logs/rollout-node-0.out")


class FakeNodeWatch:
    """Stands in for `phases.NodeWatch`: the child and the state its last poll found."""

    def __init__(self, alive: bool):
        self.child = FakeChild(alive)

    def poll(self) -> RoleState:
        return RoleState("node-0", "dead", "killed by signal 9: no error line", alive=False)


class FakeBoard:
    """Stands in for `phases.Board`: the launcher's nodes, the learner's roster, the launcher's config."""

    def __init__(self, own_alive: bool, roster: set[str]):
        launcher = type("FakeLauncher", (), {"cfg": build({}, []), "run_dir": pathlib.Path("/runs/x")})
        launcher.node_command = lambda: "streamrl rollout ..."
        self.launcher, self.nodes = launcher, {"node-0": FakeNodeWatch(own_alive)}
        self.learner = type("FakeLearnerWatch", (), {"registered": roster})


def test_a_node_in_the_roster_keeps_the_run_going_after_the_launchers_own_died():
    watch = _NodeWatch(FakeBoard(own_alive=False, roster={"vm-1234"}), wait_s=5.0)
    watch.check(now=0.0)
    watch.check(now=100.0)  # no error, long past the wait: a replacement started by hand is live


def test_no_node_anywhere_for_the_wait_ends_the_run_saying_so():
    board = FakeBoard(own_alive=False, roster=set())
    watch = _NodeWatch(board, wait_s=5.0)
    watch.check(now=10.0)  # the wait starts
    watch.check(now=14.9)  # 4.9 s < 5 s: not yet
    said = r"every rollout node exited; node-0 killed by signal 9: .*no rollout node has been live for 5 s"
    with pytest.raises(RuntimeError, match=said):
        watch.check(now=15.0)


def test_a_node_joining_within_the_wait_starts_it_again():
    board = FakeBoard(own_alive=False, roster=set())
    watch = _NodeWatch(board, wait_s=5.0)
    watch.check(now=0.0)
    board.learner.registered = {"vm-1234"}
    watch.check(now=4.0)
    board.learner.registered = set()
    watch.check(now=4.5)  # empty again: a new wait from here, not the old one's remainder (0.5 s left)
    watch.check(now=9.4)  # 4.9 s into the new wait
    with pytest.raises(RuntimeError, match="no rollout node has been live for 5 s"):
        watch.check(now=9.5)
