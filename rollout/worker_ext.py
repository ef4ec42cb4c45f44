"""The rollout side of the weight broadcast: into a running vLLM engine, or into a transformers model.

vLLM: `WeightReceiverExtension` is the engine's `worker_extension_cls`; `apply_to_async_llm`
pauses generation with in-flight requests kept, has every worker join the node's weight group and
receive the buckets (a blocking receive that would stall the engine core's loop, hence the pause),
loads them with `reload_weights` (a plain `model.load_weights` on the live model fails in vLLM
0.32), resets the prefix cache, and always resumes. No `timeout=` on `collective_rpc`: a timed-out
RPC leaves the worker blocked and kills the engine core; the group's own timeout bounds the receive.
"""

from __future__ import annotations

import time
import traceback

import torch

from streamrl.engine import messages, weights
from streamrl.engine.messages import WeightsReady
from streamrl.engine.weights import WeightTransferError
from streamrl.rollout import lifeline

WORKER_EXTENSION = "streamrl.rollout.worker_ext.WeightReceiverExtension"

# vLLM imports this module inside its engine core and workers. A forked one watches its parent
# already (lifeline's after-fork hook); a spawned one starts its watch here. In a main process
# (the node itself) this does nothing.
if lifeline.watch_parent():
    lifeline.children_die_with_me()


def _decode_ready(ready_bytes: bytes) -> WeightsReady:
    ready = messages.decode_control(ready_bytes)
    if not isinstance(ready, WeightsReady):
        raise TypeError(f"receive_weights got a {type(ready).__name__}, expected WeightsReady")
    return ready


class WeightReceiverExtension:
    """Mixed into each vLLM worker (`worker_extension_cls=WORKER_EXTENSION`).

    Worker rank r (tensor/pipeline parallel) is rank r + 1 of the node's weight group.
    """

    def receive_weights(self, ready_bytes: bytes) -> dict:
        """Receive and load one `WeightsReady` (msgpack bytes); never raises into the engine core."""
        start = time.perf_counter()
        try:
            ready = _decode_ready(ready_bytes)
            rank = 1 + int(getattr(self, "rank", 0))
            # every bucket in before loading: a transfer that fails half-way must leave the old weights whole
            named = list(weights.receive(ready, self.device, rank=rank))
            reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights
            reload(weights_iterator=named)
            return {"version": ready.version, "seconds": time.perf_counter() - start, "error": ""}
        except Exception as e:
            detail = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
            return {"version": -1, "seconds": time.perf_counter() - start, "error": detail}


async def apply_to_async_llm(engine, ready: WeightsReady) -> dict:
    """Pause (keep requests) -> every worker receives and loads -> reset prefix cache -> resume.

    Returns `{"version", "seconds"}`; raises `WeightTransferError` when a worker failed (after
    resuming: the engine keeps generating with the weights it had).
    """
    start = time.perf_counter()
    await engine.pause_generation(mode="keep")
    try:
        results = await engine.collective_rpc("receive_weights", args=(messages.encode(ready),))
        errors = [r["error"] for r in results if r.get("error")]
        if errors:
            raise WeightTransferError(
                f"learner@{ready.store_host}:{ready.store_port}",
                "apply",
                f"{len(errors)}/{len(results)} worker(s) failed: {errors[0]}",
            )
        versions = {r["version"] for r in results}
        if versions != {ready.version}:
            raise WeightTransferError(
                f"learner@{ready.store_host}:{ready.store_port}",
                "apply",
                f"workers loaded versions {sorted(versions)}, expected {ready.version}",
            )
        await engine.reset_prefix_cache(reset_running_requests=True)
    finally:
        await engine.resume_generation()
    return {"version": ready.version, "seconds": time.perf_counter() - start}


def apply_to_hf_model(model: torch.nn.Module, ready: WeightsReady, device: torch.device | str) -> None:
    """Receive into a transformers model's parameters and buffers in place (tied ones share storage)."""
    targets, peer = model.state_dict(), f"learner@{ready.store_host}:{ready.store_port}"
    received = list(weights.receive(ready, device))  # all of it first: a failed transfer changes nothing
    for name, tensor in received:
        target = targets.get(name)
        if target is None:
            raise WeightTransferError(peer, "apply", f"tensor {name!r} is not in the model (same architecture?)")
        if target.shape != tensor.shape:
            raise WeightTransferError(
                peer, "apply", f"tensor {name!r} is {list(tensor.shape)}, the model has {list(target.shape)}"
            )
    with torch.no_grad():
        torch._foreach_copy_([targets[name] for name, _ in received], [tensor for _, tensor in received])
