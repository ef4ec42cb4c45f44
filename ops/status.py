"""`streamrl status --run ID`: a run's books from the ledger, as a table; exit 1 when they do not balance."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from streamrl.engine.ledger import Ledger, LedgerError
from streamrl.engine.redis_server import RedisUnavailableError, connect, redact


def status_command(run: str, redis_url: str, deep: bool = False, console: Console | None = None) -> int:
    """Print the run's ledger; 0 when `total == trained + dropped + in flight`, 1 when not, 2 when unreachable.

    `deep` also recounts every sample record against the counters (a full scan of the run's keys).
    """
    console = console or Console()
    try:
        ledger = Ledger(connect(redis_url, retries=3), run)
        counts = ledger.counts()
        if counts.total == 0 and ledger.capacity() is None:
            console.print(f"[red]no run {run!r} in the ledger at {redact(redis_url)}[/red]")
            return 1
        console.print(_table(ledger, counts))
        errors = ledger.check(deep=deep)
    except (RedisUnavailableError, LedgerError) as e:
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


def _table(ledger: Ledger, counts) -> Table:
    table = Table(title=f"run {ledger.run}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("current policy version", ledger.current_version()),
        ("nodes alive", ", ".join(ledger.alive_nodes()) or "none"),
        ("groups in flight / capacity", f"{ledger.groups_in_flight()} / {ledger.capacity()}"),
        ("samples (total admitted)", counts.total),
        (
            "in flight",
            f"{counts.in_flight} (admitted {counts.admitted}, generated {counts.generated}, "
            f"received {counts.received})",
        ),
        ("trained", counts.trained),
        ("dropped", counts.dropped),
    ]
    rows += [(f"  dropped:{reason}", n) for reason, n in counts.dropped_by_reason.items()]
    histogram = ledger.staleness_histogram()
    rows += [("staleness at training", " ".join(f"{lag}:{n}" for lag, n in histogram.items()) or "-")]
    for name, value in rows:
        table.add_row(name, str(value))
    return table
