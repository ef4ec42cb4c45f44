"""What each process of a `streamrl run` is doing, read from its console log (`RUN/logs/<name>.out`) as it grows.

The reader keys on lines the roles write for it, and on nothing else of their output:
- a rollout node (rollout/service.py): `phase: loading ...`, `phase: registering ...`,
  `phase: registered ...`, `phase: generating`, then `policy version N live` per weights version;
- the learner (learner/orchestrator.py, nodes.py, intake.py): `learner up:` once its sockets are
  bound (when it also writes RUN/learner.json), `node X joined` / `left` / `was evicted` /
  `stopped beating`, `waited N s for trajectories: ...; HINT`, and its `WARNING:` lines (the view
  prints them on the console: a step with zero reward variance, ...).
Everything else a role prints (vLLM's own lines, tracebacks) only feeds the last error line shown
for a role that died.
"""

from __future__ import annotations

import dataclasses
import re
import signal

from streamrl.engine.telemetry import LineTail

NODE_PHASES = {
    "loading": "loading the engine",
    "registering": "registering",
    "registered": "registered",
    "generating": "generating",
}
WARMING_UP = "warming up the engines"
PHASE = re.compile(r"\bphase: (\w+)")
LIVE = re.compile(r"\bpolicy version (\d+) live\b")
JOINED = re.compile(r"\bnode (\S+) joined\b")
GONE = re.compile(r"\bnode (\S+) (?:left|was evicted|stopped beating)\b|\bevicted node (\S+):")
WAITING = re.compile(r"\bwaited \d+ s for trajectories: (.*)")
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
MAX_DETAIL = 200


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

    def __init__(self, child, name: str = "", initial: str = "starting"):
        self.child = child
        self.tail = LineTail(child.log_path, child.log_offset)
        self.state = RoleState(name or child.name, initial)
        self.last_error = ""

    def poll(self) -> RoleState:
        exited = not self.child.alive  # first: every line it wrote is in the file once it exited
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
                self.state.detail = f"{why}: {self.last_error or 'no error line; see ' + str(self.child.log_path)}"
                self.state.detail = self.state.detail[:MAX_DETAIL]
        return self.state

    def read(self, line: str) -> None:
        """One line of the log: move the state on if it says so."""


class NodeWatch(RoleWatch):
    stopped_codes = (-signal.SIGTERM,)  # the launcher's stop, often while vLLM shuts down after the node's goodbye

    def read(self, line: str) -> None:
        phase = PHASE.search(line)
        if phase and phase.group(1) in NODE_PHASES:
            self.state.state = NODE_PHASES[phase.group(1)]
            return
        live = LIVE.search(line)
        if live:
            self.state.detail = f"policy v{live.group(1)}"


class LearnerWatch(RoleWatch):
    """The learner, and the nodes it knows of: those it registered (started by anyone) until they go."""

    finished = "finished"
    stopped_codes = (130, -signal.SIGTERM)  # learner/main.py: stopped by a signal

    def __init__(self, child):
        super().__init__(child, "learner", initial="loading the model")
        self.registered: set[str] = set()
        self.waiting = ""  # the learner's last word while it waits for trajectories
        self.came_up = False  # its sockets were bound, and so the run's books opened in the ledger
        self.warnings: list[str] = []  # its WARNING lines not yet taken by the view (`take_warnings`)

    def take_warnings(self) -> list[str]:
        taken, self.warnings = self.warnings, []
        return taken

    def read(self, line: str) -> None:
        if (found := WARNING.search(line)) is not None and not WAITING.search(line):  # that one is the note
            self.warnings.append(found.group(1))
        if "learner up:" in line:
            self.state.state, self.came_up = "up", True
        elif (found := JOINED.search(line)) is not None:
            self.registered.add(found.group(1))
            self.waiting = ""
        elif (found := GONE.search(line)) is not None:
            self.registered.discard(found.group(1) or found.group(2))
        elif (found := WAITING.search(line)) is not None:
            self.waiting = found.group(1)
        elif re.search(r"\bstep \d+ v\d+ ", line):
            self.state.state, self.waiting = "training", ""


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
        self.learner: LearnerWatch | None = None
        self.nodes: dict[str, NodeWatch] = {}  # every node ever started, kept after it stopped

    @property
    def learner_up(self) -> bool:
        """The learner came up (and so opened the run's books in the ledger)."""
        return self.learner is not None and self.learner.came_up

    def poll(self, steps_done: int = 0) -> Snapshot:
        launcher = self.launcher
        if launcher.learner is not None and (self.learner is None or self.learner.child is not launcher.learner):
            self.learner = LearnerWatch(launcher.learner)  # started, or restarted
        for name, child in launcher.nodes.items():
            if name not in self.nodes or self.nodes[name].child is not child:
                self.nodes[name] = NodeWatch(child, name)
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
