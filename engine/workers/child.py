"""A worker's side of its pipe: load once, say ready (or why not), then serve calls until told to stop.

Every worker ignores Ctrl-C (it reaches the whole process group; the parent stops its workers)
and watches its parent (`lifeline.watch_parent`). Calls run on the worker's main thread, where
`signal.alarm` (math-verify's own timeout) works. Kept light on imports: with the forkserver start
method a worker module is preloaded once, so a replacement starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Callable

import msgspec

from streamrl.engine.workers import lifeline

_encoder = msgspec.msgpack.Encoder()


def serve(
    conn, setup: Callable[[], tuple[Callable, dict]], ready: type, decoder: msgspec.msgpack.Decoder, stop: type
) -> None:
    """A worker's main loop on `conn`, its end of the pipe to the pool.

    `setup()` loads what the calls need and returns `(answer, fields)`: `answer(call) -> reply` serves
    one decoded call, and `ready(pid=..., **fields)` is the handshake the parent waits for. A setup
    that raises sends `ready(pid=..., error=traceback)` instead and the worker exits. The loop ends
    on a `stop` message or when the parent's end of the pipe closes.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lifeline.watch_parent()
    try:
        answer, fields = setup()
    except Exception:
        conn.send_bytes(_encoder.encode(ready(pid=os.getpid(), error=traceback.format_exc())))
        return
    conn.send_bytes(_encoder.encode(ready(pid=os.getpid(), **fields)))
    while True:
        try:
            message = decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if isinstance(message, stop):
            return
        conn.send_bytes(_encoder.encode(answer(message)))
