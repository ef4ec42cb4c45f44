"""The live view's phase reader (ops/phases.py) on the events the roles write (RUN/events.jsonl, through
the roles' own `EventLog`) and on log lines as they print them (copied from a real `streamrl run` of the
tiny model), and the table it feeds (ops/live.py). The same reader runs on real roles' output in
tests/integration/test_first_hour_run.py."""

from __future__ import annotations

import pathlib
import time
from types import SimpleNamespace

from rich.console import Console

from streamrl.engine.telemetry import EVENTS_FILE, EventLog, LineTail
from streamrl.ops.live import live_table
from streamrl.ops.phases import Board, LearnerWatch, NodeWatch, error_text


class FakeChild:
    """What a watch reads of ops/launcher.py's `Child`: the log and whether the process exited."""

    def __init__(self, log_path: pathlib.Path, name: str, offset: int = 0, role: str = ""):
        self.log_path, self.name, self.log_offset = log_path, name, offset
        self.process = SimpleNamespace(returncode=None)
        self.started = time.time()
        self.events = EventLog(log_path.parent, role or name)  # RUN/events.jsonl, as the role writes it

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def emit(self, event: str, **fields) -> None:
        self.events.emit(event, **fields)

    def write(self, *lines: str) -> None:
        with self.log_path.open("a") as f:
            f.write("".join(line + "\n" for line in lines))


def test_line_tail_reads_only_new_complete_lines(tmp_path):
    path = tmp_path / "x.out"
    path.write_text("old run\n")
    tail = LineTail(path, offset=len("old run\n"))  # a resumed run appends to the same log
    assert tail.poll() == []
    with path.open("a") as f:
        f.write("Loading weights:   0%|\rLoading weights: 100%|\nhalf a li")
    assert tail.poll() == ["Loading weights: 100%|"]  # a progress bar's last state; the half line waits
    with path.open("a") as f:
        f.write("ne\n")
    assert tail.poll() == ["half a line"]
    assert LineTail(tmp_path / "none.out").poll() == []


def test_error_lines_in_each_format_a_role_prints():
    assert error_text("16:36:30 ERROR: bad input: data.path = x.jsonl does not exist") == (
        "bad input: data.path = x.jsonl does not exist"
    )
    assert error_text("(EngineCore pid=12545) ERROR 11-30 16:28:50 [core.py:1012] EngineCore failed to start.") == (
        "EngineCore failed to start."
    )
    assert error_text("RuntimeError: Unsupported CPU attention configuration: head_dim=16") == (
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    )
    assert error_text("[rank0]: streamrl.engine.models.ModelLoadError: model folder m does not exist.") == (
        "streamrl.engine.models.ModelLoadError: model folder m does not exist."
    )
    assert error_text("terminate called without an active exception") == "terminate called without an active exception"
    assert error_text("vllm.v1.engine.exceptions.EngineDeadError") == "vllm.v1.engine.exceptions.EngineDeadError"
    assert error_text("error: ledger.on_node_lost = 'readmit': ...; use 'drop'") == (
        "ledger.on_node_lost = 'readmit': ...; use 'drop'"
    )
    for line in (
        "16:35:47 INFO: learner up: control tcp://127.0.0.1:35495",
        "(MainProcess pid=12389) WARNING 11-30 16:28:24 [cpu.py:224] Triton is not installed.",
        '  File "/x/rollout/service.py", line 12, in serve',
        "16:36:17 WARNING: waited 30 s for trajectories: 0 groups partly here; no rollout node registered",
    ):
        assert error_text(line) is None, line


def test_a_node_moves_through_its_phases_then_dies_with_its_last_error_line(tmp_path):
    child = FakeChild(tmp_path / "rollout-node-0.out", "rollout-node-0", role="node-0")
    watch = NodeWatch(child, tmp_path / EVENTS_FILE, "node-0")
    seen = [str(watch.poll())]
    EventLog(tmp_path, "node-1").emit("phase", phase="generating")  # another node's: not this one's state
    for event, fields in (
        ("phase", {"phase": "loading"}),
        ("other", {}),
        ("phase", {"phase": "registering"}),
        ("phase", {"phase": "registered"}),
        ("phase", {"phase": "generating"}),
        ("live", {"version": 1}),
    ):
        child.emit(event, **fields)
        seen.append(str(watch.poll()))
    assert seen == [
        "starting",
        "loading the engine",
        "loading the engine",
        "registering",
        "registered",
        "generating",
        "generating: policy v1",
    ]
    child.write(
        "Traceback (most recent call last):",
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16",
        "16:36:40 ERROR: 8 groups in a row failed; the last: EngineDeadError",
    )
    child.process.returncode = 2
    state = watch.poll()
    assert (state.name, state.state, state.alive) == ("node-0", "dead", False)
    assert state.detail == "exit 2: 8 groups in a row failed; the last: EngineDeadError"


def test_a_node_stopped_by_the_launcher_is_stopped_not_dead(tmp_path):
    for code, state in ((0, "stopped"), (-15, "stopped"), (-9, "dead")):
        child = FakeChild(tmp_path / f"node-{code}.out", "rollout-node-0")
        child.write("16:37:17 INFO: node node-0 done: 28 groups sent, 8 samples resolved on leaving")
        child.process.returncode = code
        assert NodeWatch(child, tmp_path / EVENTS_FILE, "node-0").poll().state == state
    assert str(NodeWatch(child, tmp_path / EVENTS_FILE, "node-0").poll()) == (
        f"dead: killed by signal 9: no error line; see {tmp_path / 'node--9.out'}"
    )


def test_the_learner_loads_comes_up_waits_trains_and_finishes(tmp_path):
    EventLog(tmp_path, "learner").emit("up")  # a learner before this one (a resumed run): not this one's
    child = FakeChild(tmp_path / "learner.out", "learner")
    watch = LearnerWatch(child, tmp_path / EVENTS_FILE)
    assert (str(watch.poll()), watch.came_up) == ("loading the model", False)
    note = "0 groups partly here; no rollout node registered; start one with `streamrl rollout --config x`"
    child.write(
        "Loading weights: 100%|██████████| 26/26 [00:00<00:00, 18362.00it/s]",
        f"16:36:17 WARNING: waited 30 s for trajectories: {note}",
    )
    child.emit("up", control="tcp://127.0.0.1:35495", trajectories="tcp://127.0.0.1:36279")
    child.emit("waiting", note=note)
    assert (str(watch.poll()), watch.came_up) == ("up", True)
    assert watch.take_warnings() == []  # the waiting hint is the view's note, not a warning printed above it
    assert watch.waiting == note
    child.emit("node_joined", node="node-0")
    child.emit("node_joined", node="hand-7")
    child.emit("node_joined", node="lost-1")
    child.emit("node_joined", node="slow-2")
    watch.poll()
    assert watch.registered == {"node-0", "hand-7", "lost-1", "slow-2"} and watch.waiting == ""
    child.emit("step", step=1, version=1)
    child.emit("node_left", node="hand-7")
    child.emit("node_lost", node="lost-1", why="lost: no heartbeat")
    child.emit("node_evicted", node="slow-2", why="version 1 not live")
    assert str(watch.poll()) == "training" and watch.registered == {"node-0"}
    child.process.returncode = 0
    assert str(watch.poll()) == "finished"


def test_a_learner_that_died_before_it_came_up(tmp_path):
    child = FakeChild(tmp_path / "learner.out", "learner")
    watch = LearnerWatch(child, tmp_path / EVENTS_FILE)
    child.write("error: ledger.on_node_lost = 'readmit': rollout nodes do not yet re-generate; use 'drop'")
    child.process.returncode = 2
    state = watch.poll()
    assert (state.state, state.detail, watch.came_up) == (
        "dead",
        "exit 2: ledger.on_node_lost = 'readmit': rollout nodes do not yet re-generate; use 'drop'",
        False,
    )


class FakeLauncher:
    """What the board reads of ops/launcher.py's `Launcher`."""

    def __init__(self, run_dir: pathlib.Path):
        self.ledger_url, self.learner, self.nodes, self.run_dir = None, None, {}, run_dir

    def node_command(self) -> str:
        return "streamrl rollout --config runs/r/config.toml --learner runs/r"


def test_the_board_names_each_phase_of_a_start(tmp_path):
    launcher = FakeLauncher(tmp_path)
    board = Board(launcher, requested_nodes=1)
    phases = [board.poll().phase]
    launcher.ledger_url = "redis://127.0.0.1:6379/0"
    phases.append(board.poll().phase)
    launcher.learner = FakeChild(tmp_path / "learner.out", "learner")
    phases.append(board.poll().phase)
    launcher.learner.emit("up")
    launcher.nodes["node-0"] = node = FakeChild(tmp_path / "rollout-node-0.out", "rollout-node-0", role="node-0")
    phases.append(board.poll().phase)
    node.emit("phase", phase="registered")
    phases.append(board.poll().phase)
    phases.append(board.poll(steps_done=1).phase)
    launcher.learner.process.returncode = 0
    phases.append(board.poll(steps_done=3).phase)
    assert phases == [
        "starting Redis",
        "starting the learner",
        "loading the model (learner)",
        "warming up the engines",
        "waiting for the first batch",
        "training",
        "finished",
    ]
    assert board.learner_up


def test_zero_nodes_the_board_shows_the_command_and_nodes_started_by_hand(tmp_path):
    launcher = FakeLauncher(tmp_path)
    launcher.ledger_url = "redis://127.0.0.1:6379/0"
    launcher.learner = FakeChild(tmp_path / "learner.out", "learner")
    launcher.learner.emit("up")
    board = Board(launcher, requested_nodes=0)
    snapshot = board.poll()
    assert snapshot.phase == (
        "waiting for a rollout node: start one with `streamrl rollout --config runs/r/config.toml --learner runs/r`"
    )
    launcher.learner.emit("node_joined", node="box-4242")
    snapshot = board.poll()
    assert snapshot.phase == "waiting for the first batch"
    assert [str(n) for n in snapshot.nodes] == ["registered: started by hand"]


def render(table) -> str:
    console = Console(record=True, width=140, force_terminal=False)
    console.print(table)
    return console.export_text()


def test_the_table_shows_phases_before_the_first_step_and_figures_after(tmp_path):
    launcher = FakeLauncher(tmp_path)
    launcher.ledger_url = "redis://x"
    launcher.learner = FakeChild(tmp_path / "learner.out", "learner")
    launcher.nodes["node-0"] = node = FakeChild(tmp_path / "rollout-node-0.out", "rollout-node-0")
    node.write("16:36:40 ERROR: bad input: data.path = x.jsonl does not exist")
    node.process.returncode = 2
    board = Board(launcher, requested_nodes=1)
    text = render(live_table(board.poll(), [], steps=10, elapsed_s=5.2))
    assert "streamrl — step 0/10 — 5 s" in text
    assert "phase" in text and "loading the model (learner)" in text
    assert "node-0" in text and "dead: exit 2: bad input: data.path = x.jsonl does not exist" in text
    assert "reward" not in text  # no row of dashes before a step finished
    records = [{"step": 1, "reward/mean": 0.25, "reward/std": 0.1, "loss": -0.5, "version": 1}]
    text = render(live_table(board.poll(steps_done=1), records, steps=10, elapsed_s=60))
    assert "streamrl — step 1/10 — 60 s" in text and "0.250 ± 0.100" in text and "-0.5000" in text


def test_episode_figures_have_their_rows(tmp_path):
    launcher = FakeLauncher(tmp_path)
    launcher.ledger_url = "redis://x"
    launcher.learner = FakeChild(tmp_path / "learner.out", "learner")
    board = Board(launcher, requested_nodes=0)
    figures = {"env/episodes": 16.0, "env/turns_mean": 2.5, "env/reward_mean": 0.25, "env/tool_calls": 12.0}
    records = [{"step": 1, "reward/mean": 0.25, **figures, "env/tool_failed": 3.0, "env/tool_timeouts": 1.0}]
    text = render(live_table(board.poll(steps_done=1), records, steps=10, elapsed_s=60))
    assert "2.50 turns, environment reward 0.250" in text and "12 (3 failed, 1 timed out)" in text


def test_without_a_terminal_the_width_and_the_lines_do_not_depend_on_columns(monkeypatch, capsys):
    from streamrl.ops.live import NO_TERMINAL_WIDTH, plain_console

    line = "error: the ledger (Redis in /tmp/" + "deep/" * 60 + "redis) stopped answering for more than ..."
    printed = {}
    for columns in (None, "80", "40"):
        if columns is None:
            monkeypatch.delenv("COLUMNS", raising=False)
        else:
            monkeypatch.setenv("COLUMNS", columns)
        console = plain_console()  # pytest captures stdout: no terminal
        assert not console.is_terminal and console.width == NO_TERMINAL_WIDTH, columns
        console.print(line)  # longer than any width: one line all the same
        printed[columns] = capsys.readouterr().out
    assert printed == {None: line + "\n", "80": line + "\n", "40": line + "\n"}


def test_the_view_prints_each_kind_of_learner_warning_once(tmp_path):
    from streamrl.ops.run import _View

    launcher = FakeLauncher(tmp_path)
    launcher.learner = child = FakeChild(tmp_path / "learner.out", "learner")
    launcher.run_dir = tmp_path
    board = Board(launcher, requested_nodes=0)
    console = Console(record=True, width=300)
    view = _View(SimpleNamespace(console=console), board, steps=10, started=0.0)
    zero = "step {} : all 4 groups have zero reward variance (every reward = 0 in its group)"
    child.write(*(f"16:36:{40 + i} WARNING: {zero.format(i)}" for i in range(1, 4)), "16:36:44 INFO: step 3 v3")
    board.poll()
    view.print_warnings()
    printed = console.export_text()
    assert printed.count("learner warning: ") == 1 and zero.format(1) in printed
    assert view.warned == {zero.format("N").replace("4 groups", "N groups").replace("= 0", "= N"): 3}


def test_a_dead_roles_error_line_is_shown_whole(tmp_path):
    # the always-NaN reward's stop, as the learner prints it: the reward's name sits past character 160
    child = FakeChild(tmp_path / "learner.out", "learner")
    watch = LearnerWatch(child, tmp_path / EVENTS_FILE)
    first = "the run stops: the reward failed on 64 of the last 64 samples (" + "x" * 150 + ")"
    line = f"{first}; first error: nan_always: streamrl.rewards.call.RewardValueError: returned nan"
    child.write(f"16:40:01 ERROR: {line}")
    child.process.returncode = 3
    state = watch.poll()
    assert state.state == "dead" and state.detail == f"exit 3: {line}" and len(state.detail) > 250


def test_a_nodes_warnings_reach_the_view_each_kind_once_across_nodes(tmp_path):
    # the line a node's scorer logs when a reward batch fell back to one sample a call (rewards/scorer.py)
    from streamrl.ops.run import _View

    launcher = FakeLauncher(tmp_path)
    launcher.run_dir = tmp_path
    launcher.learner = FakeChild(tmp_path / "learner.out", "learner")
    fell_back = "reward 'r.py:f' raised on a batch of {} samples (KeyError: 'x'); each sample was scored alone"
    for i, n in enumerate((8, 16)):
        launcher.nodes[f"node-{i}"] = node = FakeChild(tmp_path / f"node-{i}.out", f"rollout-node-{i}")
        node.write(f"16:36:4{i} WARNING: {fell_back.format(n)}", "Traceback (most recent call last):", "KeyError: 'x'")
    board = Board(launcher, requested_nodes=2)
    console = Console(record=True, width=300)
    view = _View(SimpleNamespace(console=console), board, steps=10, started=0.0)
    board.poll()
    view.print_warnings()
    printed = console.export_text()
    assert printed.count(" warning: ") == 1 and f"node-0 warning: {fell_back.format(8)}" in printed
    assert "Traceback" not in printed  # the first line only; the node's log has the rest
    launcher.learner.process.returncode = 0  # the run ended: a node's word on its learner's end is not shown
    gone = "node node-0 stops without the grace: the learner it serves is gone"  # rollout/service.py
    launcher.nodes["node-0"].write(f"16:37:00 WARNING: {gone}")
    board.poll()
    assert board.take_warnings() == []
