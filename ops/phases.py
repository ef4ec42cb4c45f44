"""What each process of a `streamrl run` is doing, read from the run's events (`RUN/events.jsonl`) as they come.

The state is read from the structured events the roles write for it (engine/telemetry.py `EventLog`),
each process's own (its role, from its start on):
- a rollout node (rollout/service.py, node.py): `phase` (loading, registering, registered, generating),
  then `live` per weights version;
- the learner (learner/orchestrator.py, intake.py): `up` once its sockets are bound (when it also
  writes RUN/learner.json), `waiting` (its note while it waits for trajectories), `step`; and its
  roster from `NodeRegistry`, the roster's one owner: `node_joined`, `node_left`, `node_evicted`,
  `node_lost`.
The console log (`RUN/logs/<name>.out`) gives only what the view prints as it is: the learner's
`WARNING:` lines (a step with zero reward variance, ...), and the last error line shown for a role
that died (the streamrl format, vLLM's, a traceback's last line).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import signal

from streamrl.engine.telemetry import EVENTS_FILE, LineTail, MetricsTail

NODE_PHASES = {
    "loading": "loading the engine",
    "registering": "registering",
    "registered": "registered",
    "generating": "generating",
}
WARMING_UP = "warming up the engines"
GONE = ("node_left", "node_evicted", "node_lost")
WAITING = re.compile(r"\bwaited \d+ s for trajectories: ")  # a warning the view shows as its note instead
WARNING = re.compile(r"^\d\d:\d\d:\d\d WARNING: (.+)")  # the streamrl console format
# the streamrl console format (HH:MM:SS LEVEL: message), vLLM's (... ERROR 11-30 12:00:00 [file.py:1] message),
# a traceback's last line (module.SomeError: message), and `error: message` printed before logging starts
ERROR_LINES = (
    re.compile(r"^\d\d:\d\d:\d\d (?:ERROR|CRITICAL): (.+)"),
    re.compile(r"\b(?:ERROR|CRITICAL) [\d-]+ [\d:]+ \[[^]]*\] (.+)"),
    re.compile(r"^((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?:: .+)?)$"),
    re.compile(r"^error: (.+)"),
    re.compile(r"^(terminate called .+)"),  # C++ std::terminate, then SIGABRT
)
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torch.distributed prefixes a rank's traceback lines


def error_text(line: str) -> str | None:
    """The message of an error line, or None when the line is not one."""
    line = RANK_PREFIX.sub("", line.strip())
    for pattern in ERROR_LINES:
        found = pattern.search(line)
        if found:
            return found.group(1).strip()
    return None


@dataclasses.dataclass
class RoleState:
    name: str
    state: str = "starting"
    detail: str = ""  # a dead role's exit and last error line; a node's live policy version
    alive: bool = True

    def __str__(self) -> str:
        return f"{self.state}: {self.detail}" if self.detail else self.state


class RoleWatch:
    """One child process of the launcher (ops/launcher.py `Child`): its state from its log and its exit."""

    finished = "stopped"  # the state of a clean exit (code 0)
    stopped_codes: tuple[int, ...] = ()  # exit codes (besides 0) of a role that stopped when asked

    role = ""  # whose events are this process's: the learner's, or a node's id (its name)

    def __init__(self, child, events: pathlib.Path, name: str = "", initial: str = "starting"):
        self.child = child
        self.tail = LineTail(child.log_path, child.log_offset)
        self.events = MetricsTail(events)
        self.state = RoleState(name or child.name, initial)
        self.role = self.role or self.state.name
        self.last_error = ""
        self.warnings: list[str] = []  # its WARNING lines not yet taken by the view (`take_warnings`)

    def take_warnings(self) -> list[str]:
        taken, self.warnings = self.warnings, []
        return taken

    def poll(self) -> RoleState:
        exited = not self.child.alive  # first: every line it wrote is in the files once it exited
        for event in self.events.poll():
            if event.get("role") == self.role and event.get("t", 0.0) >= self.child.started:
                self.on_event(event)
        for line in self.tail.poll():
            error = error_text(line)
            if error:
                self.last_error = error
            self.read(line)
        if exited and self.state.alive:
            code = self.child.process.returncode
            self.state.alive = False
            if code == 0:
                self.state.state, self.state.detail = self.finished, ""
            elif code in self.stopped_codes:
                self.state.state, self.state.detail = "stopped", ""
            else:
                why = f"killed by signal {-code}" if code < 0 else f"exit {code}"
                self.state.state = "dead"
                # the error's line whole (the console and `streamrl status` show it; a cut one hid the reward's name)
                self.state.detail = f"{why}: {self.last_error or 'no error line; see ' + str(self.child.log_path)}"
        return self.state

    def on_event(self, event: dict) -> None:
        """One of this process's events: move the state on."""

    def read(self, line: str) -> None:
        """One line of the log, for what the view prints as it is: its WARNING lines (a node's reward that fell
        back to one sample a call, ...)."""
        if (found := WARNING.search(line)) is not None:
            self.warnings.append(found.group(1))


class NodeWatch(RoleWatch):
    stopped_codes = (-signal.SIGTERM,)  # the launcher's stop, often while vLLM shuts down after the node's goodbye

    def on_event(self, event: dict) -> None:
        if event["event"] == "phase" and event.get("phase") in NODE_PHASES:
            self.state.state = NODE_PHASES[event["phase"]]
        elif event["event"] == "live":
            self.state.detail = f"policy v{event['version']}"
        elif event["event"] == "asleep":  # sync mode on the learner's device: while the learner trains
            self.state.detail = f"policy v{event['version']}, asleep"


class LearnerWatch(RoleWatch):
    """The learner, and the nodes it knows of: those it registered (started by anyone) until they go."""

    finished = "finished"
    stopped_codes = (130, -signal.SIGTERM)  # learner/main.py: stopped by a signal

    role = "learner"

    def __init__(self, child, events: pathlib.Path):
        super().__init__(child, events, "learner", initial="loading the model")
        self.registered: set[str] = set()
        self.waiting = ""  # the learner's last word while it waits for trajectories
        self.came_up = False  # its sockets were bound, and so the run's books opened in the ledger

    def on_event(self, event: dict) -> None:
        kind = event["event"]
        if kind == "up":
            self.state.state, self.came_up = "up", True
        elif kind == "node_joined":
            self.registered.add(event["node"])
            self.waiting = ""
        elif kind in GONE:
            self.registered.discard(event["node"])
        elif kind == "waiting":
            self.waiting = event["note"]
        elif kind == "step":
            self.state.state, self.waiting = "training", ""

    def read(self, line: str) -> None:
        if not WAITING.search(line):  # that one is the note
            super().read(line)


@dataclasses.dataclass
class Snapshot:
    """The run as the live view shows it: a phase, then the learner's state and each node's."""

    phase: str
    learner: RoleState | None
    nodes: list[RoleState]
    note: str = ""


class Board:
    """Watches every process of a launcher (ops/launcher.py) and names the run's phase."""

    def __init__(self, launcher, requested_nodes: int):
        self.launcher, self.requested = launcher, requested_nodes
        self.events = pathlib.Path(launcher.run_dir) / EVENTS_FILE
        self.learner: LearnerWatch | None = None
        self.nodes: dict[str, NodeWatch] = {}  # every node ever started, kept after it stopped

    @property
    def learner_up(self) -> bool:
        """The learner came up (and so opened the run's books in the ledger)."""
        return self.learner is not None and self.learner.came_up

    def take_warnings(self) -> list[tuple[str, str]]:
        """(role, warning) for each WARNING line the learner and the nodes this launcher started logged since the
        last call (read by `poll`). Once the learner has exited, the nodes' are left out: they are about its end
        (a node finding its learner gone at the end of every run), which the view says itself."""
        watches = [self.learner] if self.learner is not None else []
        if self.learner is None or self.learner.state.alive:
            watches += self.nodes.values()
        return [(w.state.name, text) for w in watches for text in w.take_warnings()]

    def poll(self, steps_done: int = 0) -> Snapshot:
        launcher = self.launcher
        if launcher.learner is not None and (self.learner is None or self.learner.child is not launcher.learner):
            self.learner = LearnerWatch(launcher.learner, self.events)  # started, or restarted
        for name, child in launcher.nodes.items():
            if name not in self.nodes or self.nodes[name].child is not child:
                self.nodes[name] = NodeWatch(child, self.events, name)
        learner = self.learner.poll() if self.learner is not None else None
        nodes = [watch.poll() for watch in self.nodes.values()]
        if self.learner is not None:  # nodes the learner registered that this launcher did not start
            by_hand = sorted(self.learner.registered - set(self.nodes))
            nodes += [RoleState(name, "registered", "started by hand") for name in by_hand]
        phase = self._phase(learner, nodes, steps_done)
        # while this run's nodes still start, the phase says so better than the learner's waiting hint
        note = self.learner.waiting if self.learner is not None and phase != WARMING_UP else ""
        return Snapshot(phase, learner, nodes, note)

    def _phase(self, learner: RoleState | None, nodes: list[RoleState], steps_done: int) -> str:
        if learner is None:
            return "starting Redis" if self.launcher.ledger_url is None else "starting the learner"
        if not learner.alive:
            return "finished" if learner.state == "finished" else "the learner exited"
        if learner.state == "loading the model":
            return "loading the model (learner)"
        if steps_done:
            return "training"
        running = [n for n in nodes if n.alive]
        if any(n.state in ("registered", "generating") for n in running):
            return "waiting for the first batch"
        if running:
            return WARMING_UP
        if self.requested == 0 and not nodes:
            return f"waiting for a rollout node: start one with `{self.launcher.node_command()}`"
        return "no rollout node is running: the learner waits"
