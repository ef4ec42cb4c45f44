"""`streamrl status --run ID`: a run's books from the ledger, as a table; exit 1 when they do not balance.

In-flight samples are shown by holder: live nodes, gone nodes (no heartbeat: they will never
deliver them; the learner's reaper or `Ledger.resolve_node` resolves them), the learner (received,
not trained yet) and, in readmit mode, groups waiting for a node. On a run that has finished
(`Ledger.finish_run`), anything still in flight is an error: nothing will resolve it any more.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil
import tempfile
import time

from rich.console import Console
from rich.table import Table

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger import Counts, InFlight, Ledger, LedgerError, LedgerUnavailableError
from streamrl.engine.redis_server import RedisUnavailableError, connect, redact
from streamrl.engine.telemetry import ending_torn, read_ending, read_metrics
from streamrl.ops.eval_status import eval_lines
from streamrl.ops.lock import describe, holder
from streamrl.ops.progress import trained_rate
from streamrl.rollout.learner_gone import process_gone as _process_gone  # its test reads it here

RETRY_S = 5.0  # a person waits for this command: a Redis that went away mid-read fails it soon


def status_command(
    run: str, redis_url: str, deep: bool = False, console: Console | None = None, run_dir: pathlib.Path | None = None
) -> int:
    """Print the run's ledger; 0 when the books balance, 1 when not (or a finished run left samples
    unresolved), 2 when Redis cannot be reached.

    `deep` also recounts every sample record against the counters (a full scan of the run's keys).
    `run_dir`: the run's folder, whose end.json (written by the learner as it exits) says how it ended.
    """
    console = console or Console()
    try:
        ledger = Ledger(connect(redis_url, retries=3), run, LedgerConfig(retry_s=RETRY_S))
        counts = ledger.counts()
        if counts.total == 0 and ledger.capacity() is None:
            console.print(f"[red]no run {run!r} in the ledger at {redact(redis_url)}[/red]")
            return 1
        console.print(_table(ledger, counts, ledger.in_flight(), read_ending(run_dir) if run_dir else None, run_dir))
        if run_dir is not None and ending_torn(run_dir):
            console.print(f"[yellow]{run_dir / 'end.json'} is torn: skipped (the ledger says how the run ended)[/]")
        for line in eval_lines(ledger.client, run):  # evaluations: apart from the books (ops/eval_status.py)
            console.print(line)
        errors = ledger.check(deep=deep)
    except (RedisUnavailableError, LedgerUnavailableError, LedgerError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    for error in errors:
        console.print(f"[red]books do not balance: {error}[/red]")
    if not errors:
        console.print(
            f"books balance: {counts.total} = {counts.trained} trained + {counts.dropped} dropped "
            f"+ {counts.in_flight} in flight"
        )
    return 1 if errors else 0


def status_cli(run: str, redis_url: str, runs_dir: pathlib.Path, deep: bool) -> int:
    """`streamrl status`: the named run, else the newest in `runs_dir` (said on stderr); its ledger from
    `redis_url`, else the server of a run going on (config.toml's URL), else, for a run no process owns
    (ops/lock.py), a copy of its folder's AOF in a server of our own. A live run's files are never opened by a
    second server: with its ledger not answering, that is what is said (exit 2)."""
    import sys

    if not run:
        run = newest_run(runs_dir)
        if not run:
            print(f"error: no run folder in {runs_dir}/; give --run NAME (and --runs-dir)", file=sys.stderr)
            return 2
        print(f"run {run} (the newest in {runs_dir}/; --run NAME for another)", file=sys.stderr)
    run_dir = runs_dir / run
    if redis_url:
        return status_command(run, redis_url, deep=deep, run_dir=run_dir)
    held_by = holder(run_dir)  # before the URL: a run that ends meanwhile is then read from its copy
    live = live_ledger(run_dir)  # a run going on: its own server
    if live:
        return status_command(run, live, deep=deep, run_dir=run_dir)
    if held_by is not None:
        print(
            f"error: run {run!r} is live ({describe(held_by)}) but its ledger ({_said_url(run_dir)}) does not "
            "answer: no server was started on its files; try again in a moment, or give --redis-url",
            file=sys.stderr,
        )
        return 2
    folder = run_dir / "redis"
    if not folder.is_dir():
        print(f"error: no ledger at {folder}; give --redis-url for a run on another server", file=sys.stderr)
        return 2
    with _read_copy(folder) as url:
        return status_command(run, url, deep=deep, run_dir=run_dir)


@contextlib.contextmanager
def _read_copy(folder: pathlib.Path):
    """The URL of a server of our own on a copy of a stopped run's ledger folder (`RUN/redis`), removed
    after: the run's own files are read, never written (a server writes its config, log and AOF)."""
    from streamrl.engine.redis_server import RedisServer

    with tempfile.TemporaryDirectory(prefix="streamrl-status-") as tmp:
        copy = pathlib.Path(tmp) / "redis"
        shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("redis.log", "*.rdb.tmp", "temp-*"))
        with RedisServer(copy) as server:
            yield server.url


def _said_url(run_dir: pathlib.Path) -> str:
    """RUN/config.toml's ledger URL, password redacted."""
    import tomllib

    try:
        return redact(tomllib.loads((run_dir / "config.toml").read_text()).get("ledger", {}).get("url", "")) or "none"
    except (OSError, tomllib.TOMLDecodeError):
        return "no config.toml"


def newest_run(runs_dir: pathlib.Path) -> str:
    """The name of the run folder under `runs_dir` whose ledger or config changed last (a run is named after
    its config or data, so a person who did not name it may not know its name); '' when there is none."""

    def changed(folder: pathlib.Path) -> float:
        marks = [folder / "redis", folder / "config.toml", folder / "metrics.jsonl", folder / "end.json"]
        return max((m.stat().st_mtime for m in marks if m.exists()), default=-1.0)

    folders = [f for f in runs_dir.iterdir() if f.is_dir() and changed(f) >= 0] if runs_dir.is_dir() else []
    return max(folders, key=changed).name if folders else ""


def live_ledger(run_dir: pathlib.Path) -> str:
    """The URL of the ledger a run going on in `run_dir` uses (RUN/config.toml, written by its launcher or
    learner), when it answers; '' when there is none (the run has ended: its embedded server stopped)."""
    import tomllib

    try:
        url = tomllib.loads((run_dir / "config.toml").read_text()).get("ledger", {}).get("url", "")
        if url:
            connect(url, retries=1, timeout_s=2.0).close()
        return url
    except (OSError, tomllib.TOMLDecodeError, RedisUnavailableError):
        return ""


def _nodes(held: dict[str, int]) -> str:
    return f"{sum(held.values())} (" + ", ".join(f"{node} {n}" for node, n in held.items()) + ")" if held else "0"


def _state(ledger: Ledger, ending: dict | None, run_dir: pathlib.Path | None = None) -> str:
    """How the run ended (RUN/end.json: the learner's words as it exited, or the launcher's for a learner that
    could not say, its error's first line whole), else finished (the ledger's mark), running (its learner
    beats: `Ledger.learner_alive`, and RUN/learner.json's process, when it ran on this machine, still runs), or
    stopped without an ending (killed, its host lost)."""
    if ending is not None:
        said = str(ending.get("detail") or "").splitlines()
        words = f": {said[0]}" if said else ""
        return f"{ending['ended']} {_when(ending['time'])}{words} (exit {ending['exit']})"
    finished = ledger.finished()
    if finished:
        return f"finished {_when(finished)}"
    learner = ledger.learner()
    gone = _process_gone(learner, run_dir)
    if ledger.learner_alive() and not gone:
        return "running"
    if not learner:
        return "no learner has announced itself"
    beat = _when(float(learner.get("beat") or learner["time"]))
    if gone:  # its heartbeat may not have lapsed yet (ledger.heartbeat_ttl_s): the process says more, sooner
        return f"stopped without an ending: {gone}; its last heartbeat {beat}"
    return f"stopped without an ending: no learner heartbeat since {beat}"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))


def _table(
    ledger: Ledger, counts: Counts, held: InFlight, ending: dict | None = None, run_dir: pathlib.Path | None = None
) -> Table:
    table = Table(title=f"run {ledger.run}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    live = {node: n for node, n in held.by_node.items() if node in held.alive}
    rows = [
        ("run", _state(ledger, ending, run_dir)),
        ("current policy version", ledger.current_version()),
        ("nodes alive", ", ".join(ledger.alive_nodes()) or "none"),
        ("groups in flight / capacity", f"{ledger.groups_in_flight()} / {ledger.capacity()}"),
        ("samples (total admitted)", counts.total),
        (
            "in flight",
            f"{counts.in_flight} (admitted {counts.admitted}, generated {counts.generated}, "
            f"received {counts.received})",
        ),
        ("  held by live nodes", _nodes(live)),
        ("  held by gone nodes", _nodes(held.held_by_gone_nodes)),
        ("  received by the learner", held.received),
    ]
    rows += [("  waiting for a node (readmit)", held.orphaned)] * bool(held.orphaned)
    rows += [("trained", counts.trained), ("dropped", counts.dropped)]
    rows += [(f"  dropped:{reason}", n) for reason, n in counts.dropped_by_reason.items()]
    histogram = ledger.staleness_histogram()
    rows += [("staleness at training", " ".join(f"{lag}:{n}" for lag, n in histogram.items()) or "-")]
    if run_dir is not None and (run_dir / "metrics.jsonl").exists():  # as the live row and the closing line give it
        rows += [("tokens/s (trained)", str(trained_rate(read_metrics(run_dir / "metrics.jsonl"))))]
    rows += [(f"rolled back to v{r['from']}", f"{r['samples']} samples (from v{r['to']})") for r in ledger.rollbacks()]
    for name, value in rows:
        table.add_row(name, str(value))
    return table
