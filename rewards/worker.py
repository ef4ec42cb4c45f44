"""The reward worker process: load the reward functions once, then serve calls until told to stop.

Calls run on this process's main thread, where `signal.alarm` (math-verify's own timeout) works.
Kept light on imports: with the forkserver start method this module is preloaded once, so a
replacement worker starts in milliseconds.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import traceback

import msgspec

from streamrl.engine.config import RewardConfig
from streamrl.engine.messages import RewardCall, RewardFromWorker, RewardReady, RewardResult, RewardStop, RewardToWorker

from .call import Batch, safe_call
from .registry import REWARD_MODEL, resolve

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RewardToWorker)
_from_worker = msgspec.msgpack.Decoder(RewardFromWorker)


def main(conn, cfg_bytes: bytes, specs: list[str]) -> None:
    """Entry point of a worker; `conn` is its end of the pipe to the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent stops us
    _die_with_parent()
    try:
        cfg = msgspec.msgpack.decode(cfg_bytes, type=RewardConfig)
        fns = [None if spec == REWARD_MODEL else resolve(spec, cfg) for spec in specs]
    except Exception:
        conn.send_bytes(_encoder.encode(RewardReady(pid=os.getpid(), error=traceback.format_exc())))
        return
    conn.send_bytes(_encoder.encode(RewardReady(pid=os.getpid())))
    while True:
        try:
            message = _decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if isinstance(message, RewardStop):
            return
        conn.send_bytes(_encoder.encode(_serve(fns, message)))


def _die_with_parent() -> None:
    # A worker stuck in a hung reward never reads its pipe, so it would outlive a SIGKILLed parent
    # (under forkserver its OS parent is the fork server, which itself waits for its children).
    # The parent's sentinel becomes ready the moment the parent is gone.
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="reward-parent-watch", daemon=True).start()


def _serve(fns: list, call: RewardCall) -> RewardResult:
    batch = Batch(
        prompts=call.prompts, completions=call.completions, completion_ids=call.completion_ids, columns=call.columns
    )
    outcome = safe_call(fns[call.fn_index], batch)
    return RewardResult(call_id=call.call_id, values=outcome.values, errors=outcome.errors, traceback=outcome.traceback)


def decode_reply(frame: bytes) -> RewardReady | RewardResult:
    return _from_worker.decode(frame)


def _enc_hook(obj):
    if hasattr(obj, "tolist"):  # numpy / torch values in dataset rows
        return obj.tolist()
    raise NotImplementedError(
        f"a dataset column value of type {type(obj).__name__} cannot be sent to a reward "
        "worker; keep columns to str, numbers, lists and dicts"
    )


_call_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_call(call: RewardCall | RewardStop) -> bytes:
    return _call_encoder.encode(call)
