"""What a ledger call raises: a move the run's state does not allow, and a Redis that stayed unreachable
or refused writes past `ledger.retry_s` (`LedgerBooks._retry` gives up with `gave_up`)."""

from __future__ import annotations


class LedgerError(RuntimeError):
    """A ledger call the run's state does not allow (node not alive, run not set up, ...)."""


class LedgerUnavailableError(RuntimeError):
    """Redis did not answer within `ledger.retry_s`; the message names the server and how long it was tried."""


class LedgerUnwritableError(LedgerUnavailableError):
    """Redis answered but refused every write for `ledger.retry_s`: its disk is full or failing (MISCONF),
    it is over maxmemory (OOM) or a replica (READONLY). Handled as a lost ledger (the books stay as they
    were, for a resume), with an exit status of its own; `refusal` is Redis's answer."""

    def __init__(self, message: str, refusal: str):
        super().__init__(message)
        self.refusal = refusal


# What to do about each refusal (`redis_server.write_refusal`), by its code
_REFUSAL_FIXES = {
    "MISCONF": "its disk is full or failing: free space where it keeps its append-only file (RUN/redis for the "
    "embedded server; its log says more)",
    "OOM": "it is over its maxmemory: raise maxmemory or give it more memory",
    "READONLY": "it is a read-only replica: point ledger.url at the primary",
}


def gave_up(
    run: str, url: str, error: Exception, refusal: str, what: str, tried: float, limit: float
) -> LedgerUnavailableError:
    """The error for a ledger call (`what`) that found Redis unreachable, or refusing writes (`refusal`, its
    answer), for `tried` seconds, past `ledger.retry_s` = `limit`."""
    longer = f"or raise ledger.retry_s = {limit:g} to wait longer"
    if refusal:
        fix = _REFUSAL_FIXES.get(refusal.split()[0], "see its log")
        return LedgerUnwritableError(
            f"ledger of run {run!r}: Redis at {url} refused writes for {tried:.1f} s ({what}: {refusal}): {fix}; "
            f"the ledger stays in Redis as it was: once it writes again, resume, {longer}",
            refusal,
        )
    return LedgerUnavailableError(
        f"ledger of run {run!r}: Redis at {url} did not answer for {tried:.1f} s ({what}: {type(error).__name__}: "
        f"{error}); the ledger stays in Redis as it was; start the server again (same port and folder) and "
        f"resume, {longer}"
    )
