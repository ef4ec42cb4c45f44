"""Where a run's ledger lives: on the Redis of `ledger.url`, else on a server embedded in the run folder."""

from __future__ import annotations

import pathlib

from streamrl.engine.config import LedgerConfig
from streamrl.engine.ledger.writer import Ledger
from streamrl.engine.redis_server import RedisServer, connect


def open_ledger(config: LedgerConfig, run: str, run_dir: str | pathlib.Path) -> tuple[Ledger, RedisServer | None]:
    """The run's ledger: on `config.url`, else on an embedded server persisting in `run_dir/redis`.

    The caller owns the returned server (None for an external one) and stops it last.
    """
    if config.url:
        return Ledger(connect(config.url, config.connect_retries), run, config), None
    server = RedisServer(pathlib.Path(run_dir) / "redis")
    try:
        return Ledger(connect(server.start(), config.connect_retries), run, config), server
    except BaseException:
        server.stop()
        raise
