"""The reward worker process: load the reward functions once, then serve calls until told to stop
(the loop, the ready handshake and the parent watch: `engine/workers/child.py`).

Kept light on imports: with the forkserver start method this module is preloaded once, so a
replacement worker starts in milliseconds.
"""

from __future__ import annotations

import msgspec

from streamrl.engine.config import RewardConfig
from streamrl.engine.messages import RewardCall, RewardFromWorker, RewardReady, RewardResult, RewardStop, RewardToWorker
from streamrl.engine.workers.child import serve

from .call import Batch, safe_call
from .registry import REWARD_MODEL, resolve

_decoder = msgspec.msgpack.Decoder(RewardToWorker)
_from_worker = msgspec.msgpack.Decoder(RewardFromWorker)


def main(conn, cfg_bytes: bytes, specs: list[str]) -> None:
    """Entry point of a worker; `conn` is its end of the pipe to the pool."""

    def setup():
        cfg = msgspec.msgpack.decode(cfg_bytes, type=RewardConfig)
        fns = [None if spec == REWARD_MODEL else resolve(spec, cfg) for spec in specs]
        for fn in fns:  # imports a reward defers (a library's) are paid here, under the boot deadline, not a call's
            if callable(getattr(fn, "warm_up", None)):
                fn.warm_up()
        return (lambda call: _serve(fns, call)), {}

    serve(conn, setup, RewardReady, _decoder, RewardStop)


def _serve(fns: list, call: RewardCall) -> RewardResult:
    batch = Batch(
        prompts=call.prompts, completions=call.completions, completion_ids=call.completion_ids, columns=call.columns
    )
    outcome = safe_call(fns[call.fn_index], batch)
    return RewardResult(
        call_id=call.call_id,
        values=outcome.values,
        errors=outcome.errors,
        traceback=outcome.traceback,
        fell_back=outcome.fell_back,
    )


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
