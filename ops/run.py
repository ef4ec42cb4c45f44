"""The `streamrl run` session: start the launcher, show the live view, stop everything, sum up."""

from __future__ import annotations

import re
import shutil
import signal
import time

from rich.console import Console
from rich.markup import escape

from streamrl.engine.auth import NO_CURVE_WARNING
from streamrl.engine.config import Config, ConfigError, presets
from streamrl.engine.telemetry import MetricsTail
from streamrl.engine.weights.paths import NAMES, planned
from streamrl.ops.closing import closing_line, summary  # noqa: F401 (summary: moved there, still imported from here)
from streamrl.ops.fresh import FreshError, set_aside
from streamrl.ops.launcher import Launcher
from streamrl.ops.live import live_table, plain_console
from streamrl.ops.lock import RunBusyError, RunOwner, this_command
from streamrl.ops.naming import DEMO, TINY, fresh_name, name_after, name_sets  # noqa: F401 (imported from here)
from streamrl.ops.phases import Board
from streamrl.ops.progress import live_output

LEARNER_UP_S = 300.0  # from the learner's start to its sockets (RUN/learner.json)
LEDGER_LOST = 4  # the learner's exit status when Redis stayed unreachable past ledger.retry_s
LEDGER_UNWRITABLE = 5  # ... when it refused writes that long (its disk full: MISCONF; OOM; READONLY)
POLL_S = 0.1  # how often the live view reads the logs and the metrics
REDRAW_S = 0.5  # the view redraws at least this often (its clock), and whenever a state changes


def run_local(
    cfg: Config,
    nodes: int,
    explicit_name: bool = False,
    console: Console | None = None,
    resume: str = "",
    owner: RunOwner | None = None,
    fresh: bool = False,
) -> int:
    """Run to the configured number of steps (or Ctrl-C); the exit status. `resume` (a checkpoint
    folder, or "latest") continues the run of that name in its folder; `fresh` starts it again, its earlier books
    set aside (ops/fresh.py). `owner`: the folder's hold, taken by `claim_run` (its config's name is final); else
    it is taken here, first (refused, exit 2, changing nothing, while another process owns the folder)."""
    console = console or plain_console()
    cfg = cfg if owner is not None else fresh_name(cfg, explicit_name or bool(resume))
    try:
        owner = owner or RunOwner.take(cfg.run.path, this_command())
        aside = set_aside(cfg.run.path, cfg.ledger.url, resume) if fresh else None
    except (RunBusyError, FreshError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 2
    if aside is not None:
        console.print(f"--fresh: run {cfg.run.name} starts again from step 1; its earlier books are kept in {aside}")
    launcher = Launcher(cfg, resume=resume, owner=owner)
    try:
        placement = launcher.plan_gpus(nodes)
    except ConfigError as e:
        console.print(f"[red]error:[/] {e}")
        launcher.owner.release()
        return 2
    board = Board(launcher, nodes)
    where = launcher.run_dir
    console.print(f"run [bold]{cfg.run.name}[/]: folder {where}, metrics {where}/metrics.jsonl, logs {where}/logs")
    if placement is not None:
        console.print(placement.describe(nodes, cfg.weights.backend))
    elif nodes:
        path = planned(cfg.weights.backend, None, None)
        console.print(f"placement: every role on the CPU; weights by {NAMES[path]}")
    if not cfg.transport.curve:
        console.print(f"[yellow]warning:[/] {NO_CURVE_WARNING}", markup=True)
    if cfg.loss.preset:
        console.print(presets.describe(cfg), markup=False)
    started, since, code, failure = time.monotonic(), time.time(), 1, ""  # since: this launch's records
    _stop_on_signals()
    previous: dict = {}
    try:
        with live_output(console) as live:  # without a terminal: a plain line per step
            view = _View(live, board, cfg.run.steps, started)
            try:
                code = _watch(launcher, view, console)
            except KeyboardInterrupt:
                console.print("[yellow]interrupted: stopping every process this run started[/]")
                code = 130
            except RuntimeError as e:
                failure = str(e)
            finally:
                # A second Ctrl-C or a SIGTERM must not cut the clean-up short and leave children running.
                previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
                launcher.stop_all(keep_redis=True)
                view.show(force=True)  # the last table: every role as it ended
        if not console.is_terminal:
            console.line()  # without a terminal the last table ends without a newline
        ending = launcher.record_ending(board.learner.last_error if board.learner is not None else "")
        if failure:
            console.print(f"[red]error:[/] {failure}")
        elif code == LEDGER_LOST:
            console.print(f"[red]error:[/] {_ledger_lost(launcher, cfg)}")
        elif code == LEDGER_UNWRITABLE:
            console.print(f"[red]error:[/] {escape(_ledger_unwritable(launcher, cfg, ending))}")
        elif board.learner is not None and board.learner.state.state == "dead":
            log = launcher.learner.log_path
            console.print(f"[red]the learner exited[/] ({board.learner.state.detail}); its log {log}")
        console.print(closing_line(launcher.run_dir, since, time.monotonic() - started, resumed=bool(resume)))
        if code != LEDGER_LOST:  # no ledger to read the books from (one that cannot write still reads)
            code = _books(launcher, board, cfg, console) or code
    finally:
        launcher.stop_redis()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def _ledger_lost(launcher: Launcher, cfg: Config) -> str:
    """The one line for a run whose ledger went away for good (the learner's exit 4)."""
    where = f" in {launcher.redis.dir}" if launcher.redis is not None else ""
    return (
        f"the ledger (Redis{where}) stopped answering for more than ledger.retry_s = {cfg.ledger.retry_s:g} s: "
        "every process of the run was stopped and its books were left as they were; once Redis is back, "
        f"continue with the same command and `--resume latest --set run.name={cfg.run.name}`"
    )


def _ledger_unwritable(launcher: Launcher, cfg: Config, ending: dict | None) -> str:
    """The one line for a run whose ledger refused writes for good (the learner's exit 5)."""
    where = launcher.redis.dir if launcher.redis is not None else None
    said = (ending or {}).get("detail", "").splitlines() if (ending or {}).get("by") == "learner" else []
    refusal = said[0] if said else f"Redis refused writes (its log: {where}/redis.log)"
    room = f" ({shutil.disk_usage(where).free / 2**20:.1f} MiB free in {where})" if where is not None else ""
    resume = (
        f"continue with the same command and `--resume latest --set run.name={cfg.run.name}`"
        if any(launcher.run_dir.glob("checkpoints/step_*/meta.json"))
        else "start the run again (no checkpoint was saved yet to resume from)"
    )
    return (
        f"the ledger cannot write: {refusal}{room}, for longer than ledger.retry_s = {cfg.ledger.retry_s:g} s: every "
        f"process of the run was stopped and its books were left as they were; free space (or mend what Redis "
        f"names), then {resume}"
    )


def _stop_on_signals() -> None:
    """A SIGTERM stops the run as cleanly as Ctrl-C; SIGINT is set too: a launcher started in the background of a
    script (`streamrl run ... &`) inherits SIGINT ignored, and a `kill -INT` then did nothing while it trained on."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


class _View:
    """The live view's state: the metrics read so far and every role's, rendered on each `show()`."""

    def __init__(self, live, board: Board, steps: int, started: float):
        self.live, self.board, self.steps, self.started = live, board, steps, started
        self.metrics = MetricsTail(board.launcher.run_dir / "metrics.jsonl")
        self.shown: tuple = ()
        self.shown_at = 0.0
        self.warned: dict[str, int] = {}  # each kind of learner warning (its text without numbers): times seen

    def show(self, force: bool = False) -> None:
        """Redraw when a phase, a role's state or the step changed (polled at POLL_S, so a phase
        shorter than a frame is still seen), else at REDRAW_S for the clock."""
        self.metrics.poll()
        snapshot = self.board.poll(len(self.metrics.records))
        self.print_warnings()
        roles = [snapshot.learner, *snapshot.nodes]
        seen = (snapshot.phase, snapshot.note, len(self.metrics.records), *(str(role) for role in roles))
        now = time.monotonic()
        if not force and seen == self.shown and now - self.shown_at < REDRAW_S:
            return
        self.shown, self.shown_at = seen, now
        self.live.update(live_table(snapshot, self.metrics.records, self.steps, now - self.started), refresh=True)

    def print_warnings(self) -> None:
        """The learner's and the nodes' warnings above the table, each kind once (a zero-variance step warns every
        step; each node's reward falls back once); their logs have them all."""
        for role, text in self.board.take_warnings():
            kind = re.sub(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", "N", text)
            self.warned[kind] = self.warned.get(kind, 0) + 1
            if self.warned[kind] == 1:
                self.live.console.print(f"[yellow]{role} warning:[/] {escape(text)}", soft_wrap=True)


def _watch(launcher: Launcher, view: _View, console: Console) -> int:
    """Start the run's processes one by one, each phase shown as it begins; follow them to the
    learner's exit; the learner's exit status."""
    view.show()  # starting Redis
    launcher.start_redis()
    view.show()
    launcher.start_learner()
    _follow(launcher, view, console)
    code = launcher.learner.process.returncode
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def _follow(launcher: Launcher, view: _View, console: Console) -> None:
    """Until the learner exits: start the nodes once it is up, refresh the view, and stop with an
    error when it never comes up or when the run has had no live node for a while before its last step."""
    board = view.board
    nodes, deadline = board.requested, time.monotonic() + LEARNER_UP_S
    started_nodes, watch = False, _NodeWatch(board, launcher.cfg.ledger.heartbeat_ttl_s)
    while launcher.learner.alive:
        if not started_nodes and launcher.learner_address() is not None:
            started_nodes = True
            for _ in range(nodes):
                launcher.add_node()
            if nodes == 0:
                command = launcher.node_command()
                console.print(f"no rollout node started (--rollout-nodes 0); start each with: {command}")
        if not started_nodes and time.monotonic() > deadline:
            log = launcher.learner.log_path
            raise RuntimeError(f"the learner was not up after {LEARNER_UP_S:.0f} s; its log {log}")
        view.show()
        records = view.metrics.records
        finishing = bool(records) and records[-1]["step"] >= launcher.cfg.run.steps  # nodes were told to stop
        if started_nodes and nodes and not finishing:
            watch.check()
        time.sleep(POLL_S)


class _NodeWatch:
    """Ends a run that has had no rollout node for `wait_s` (ledger.heartbeat_ttl_s): none of the nodes this
    launcher started alive and none in the learner's roster (events.jsonl: every node it registered and has not
    seen go, whoever started it, e.g. a replacement started by hand with `streamrl rollout --learner RUN`)."""

    def __init__(self, board: Board, wait_s: float):
        self.board, self.wait_s = board, wait_s
        self.since: float | None = None  # when the run was first seen without a node

    def check(self, now: float | None = None) -> None:
        """now: time.monotonic() unless given (a test's clock)."""
        board, now = self.board, time.monotonic() if now is None else now
        watches = list(board.nodes.values())
        roster = board.learner.registered if board.learner is not None else set()
        if roster or any(w.child.alive for w in watches):
            self.since = None
            return
        self.since = now if self.since is None else self.since
        if now - self.since < self.wait_s:
            return
        dead = [state for state in (w.poll() for w in watches) if state.state == "dead"]
        none = f"no rollout node has been live for {self.wait_s:g} s (ledger.heartbeat_ttl_s)"
        if not dead:
            why = "their prompt source ended: data.loop = false" if not board.launcher.cfg.data.loop else "exit 0"
            logs = board.launcher.run_dir / "logs"
            raise RuntimeError(
                f"every rollout node stopped ({why}) before the learner's last step; {none}; logs: {logs}"
            )
        last = dead[-1]
        log = board.nodes[last.name].child.log_path
        raise RuntimeError(f"every rollout node exited; {last.name} {last.detail}; its log {log}; {none}")


def _books(launcher: Launcher, board: Board, cfg: Config, console: Console) -> int:
    """The ledger's table; non-zero when the books do not balance. A learner that never came up never opened
    the run's books, and that is what is said; a resumed run's books were opened by an earlier launch: shown."""
    if launcher.ledger_url is None:
        return 0
    if not board.learner_up and not launcher.resume:
        console.print("no books to show: the learner never came up, so the run never started in the ledger")
        return 0
    if not board.learner_up:
        console.print("the resumed learner never came up; the run's books as earlier launches left them:")
    from streamrl.ops.status import status_command

    return status_command(cfg.run.name, launcher.ledger_url, console=console, run_dir=launcher.run_dir)
