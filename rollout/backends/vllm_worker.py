"""The rollout side of the weight push: staged while the engine generates, swapped in at a safe point.

Both backends share `weights.Stager`: a version is received into staging buffers in a thread of
its own while generation goes on; the engine then swaps it in where nothing is mid-computation.

- vLLM: `WeightReceiverExtension` is the engine's `worker_extension_cls`. `stage_weights` starts
  the worker's receive in a background thread and returns at once (the engine core keeps stepping);
  `stage_and_swap_async_llm` polls `staged_status` between engine steps, then pauses generation
  keeping the running requests, loads the staged tensors with `reload_weights` (a plain
  `model.load_weights` on the live model fails in vLLM 0.32), and always resumes; the running
  requests go on over the KV they have (`rollout.kv_at_swap = "keep"`, the default), or
  (`"recompute"`) the prefix cache and their KV are reset first, so every later token comes from
  the new weights alone.
  No `timeout=` on `collective_rpc`: a timed-out RPC leaves the worker blocked and kills the engine
  core; every RPC here returns at once, and the staging's own deadline bounds the receive.
- transformers: `swap_into_hf_model` copies the staged tensors into the model's parameters in place
  (tied ones share storage; CUDA graphs captured on those parameters stay valid).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback

import torch

from streamrl.engine import messages
from streamrl.engine.messages import WeightsReady
from streamrl.engine.weights import Staged, Stager, WeightTransferError
from streamrl.engine.workers import lifeline
from streamrl.rollout.backends.vllm_relay import RelayInWorker

WORKER_EXTENSION = "streamrl.rollout.backends.vllm_worker.WeightReceiverExtension"
STATUS_POLL_S = 0.005
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's `RotaryEmbedding: Failed to load weights` warning, logged on every `reload_weights`.

    Harmless: a rotary layer holds only its cos/sin cache, computed from the model's config, and no
    checkpoint has a tensor for it, so a reload loads nothing there and vLLM puts the same cache back
    (reload/layerwise.py). Any other layer that fails to load is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and str(args[0]).endswith("RotaryEmbedding"))


logging.getLogger(RELOAD_LOGGER).addFilter(RotaryReloadFilter())

# vLLM imports this module inside its engine core and workers. A forked one watches its parent
# already (lifeline's after-fork hook); a spawned one starts its watch here. In a main process
# (the node itself) this does nothing.
if lifeline.watch_parent():
    lifeline.children_die_with_me()


def _decode_ready(ready_bytes: bytes) -> WeightsReady:
    ready = messages.decode_control(ready_bytes)
    if not isinstance(ready, WeightsReady):
        raise TypeError(f"stage_weights got a {type(ready).__name__}, expected WeightsReady")
    return ready


class WeightReceiverExtension(RelayInWorker):
    """Mixed into each vLLM worker (`worker_extension_cls=WORKER_EXTENSION`).

    Worker rank r (tensor/pipeline parallel) is rank r + 1 of the node's weight group. Every method
    returns a dict and never raises into the engine core. The relay's methods (`relay_*`: forwarding each
    version to other nodes) are `RelayInWorker`'s (rollout/backends/vllm_relay.py).
    """

    def _staging(self) -> dict:
        if not hasattr(self, "_streamrl_staging"):
            rank = 1 + int(getattr(self, "rank", 0))
            self._streamrl_staging = {
                "stager": Stager(self.device, rank),
                "staged": None,
                "error": "",
                "lock": threading.Lock(),
            }
        return self._streamrl_staging

    def stage_weights(self, ready_bytes: bytes) -> dict:
        """Start receiving one `WeightsReady` (msgpack bytes) into staging buffers; returns at once."""
        state = self._staging()
        try:
            ready = _decode_ready(ready_bytes)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            return {"started": False, "error": f"{type(e).__name__}: {e}"}

        def receive():
            try:
                staged = state["stager"].receive(ready)
                with state["lock"]:
                    state["staged"], state["error"] = staged, ""
            except Exception as e:  # noqa: BLE001 - reported by staged_status
                with state["lock"]:
                    state["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"

        with state["lock"]:
            state["error"] = ""
        threading.Thread(target=receive, name=f"stage-v{ready.version}", daemon=True).start()
        return {"started": True, "error": ""}

    def staged_status(self) -> dict:
        state = self._staging()
        with state["lock"]:
            staged = state["staged"]
            return {"version": staged.version if staged is not None else -1, "error": state["error"]}

    def swap_staged(self) -> dict:
        """Load the staged version (call it with generation paused); the staging buffers are freed."""
        state, start = self._staging(), time.perf_counter()
        with state["lock"]:
            staged, state["staged"] = state["staged"], None
        if staged is None:
            return {"version": -1, "seconds": 0.0, "error": "nothing staged"}
        try:
            if staged.adapter is not None:
                self._add_adapter(staged)
            else:
                reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights
                reload(weights_iterator=staged.named)
            if torch.device(self.device).type == "cuda":  # done reading staging before it takes the next version
                torch.cuda.synchronize(self.device)
            return {
                "version": staged.version,
                "seconds": time.perf_counter() - start,
                "error": "",
                "nbytes": staged.nbytes,
            }
        except Exception as e:  # noqa: BLE001 - reported to the node, which tells the learner
            return {"version": -1, "seconds": 0.0, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"}
        finally:
            state["stager"].release()

    def _add_adapter(self, staged: Staged) -> None:
        """LoRA: keep the version's adapter tensors (copied out of staging, which takes the next version) and
        load them as adapter `adapter_request(version)`; vLLM's loader reads them from here, never from disk,
        also when it loads the adapter again after its LRU cache dropped it."""
        held = self._adapters()
        request = adapter_request(staged.version)
        held[request.lora_int_id] = ({name: t.clone() for name, t in staged.named}, staged.adapter)
        try:
            self.model_runner.add_lora(request)
        except BaseException:
            held.pop(request.lora_int_id, None)
            raise

    def drop_adapter(self, version: int) -> dict:
        """LoRA: forget a version's adapter (no request can use it any more): its slot and its tensors."""
        lora_id = adapter_request(version).lora_int_id
        self._adapters().pop(lora_id, None)
        return {"removed": bool(self.model_runner.remove_lora(lora_id))}

    def held_adapters(self) -> dict:
        """LoRA: the versions whose adapters this worker holds -> sha256 of their tensors (names and bytes, in
        name order): what the node serves, comparable with the learner's tensors bit for bit."""
        import hashlib

        out = {}
        for lora_id, (tensors, _) in self._adapters().items():
            digest = hashlib.sha256()
            for name in sorted(tensors):
                digest.update(name.encode())
                digest.update(tensors[name].contiguous().view(torch.uint8).cpu().numpy().tobytes())  # GPU: host bytes
            out[lora_id - 1] = digest.hexdigest()
        return out

    def _adapters(self) -> dict:
        """lora_int_id -> (tensors, AdapterSpec); made on first use, with vLLM's loader patched to read it."""
        if not hasattr(self, "_streamrl_adapters"):
            held: dict = {}
            manager = self.model_runner.lora_manager
            from_disk = manager._load_adapter

            def load(request):
                found = held.get(request.lora_int_id)
                return from_disk(request) if found is None else _lora_model(manager, request.lora_int_id, *found)

            manager._load_adapter = load
            self._streamrl_adapters = held
        return self._streamrl_adapters

    def discard_staged(self) -> dict:
        """Free the staging buffers without loading (another worker failed: the version is given up)."""
        state = self._staging()
        with state["lock"]:
            had, state["staged"] = state["staged"] is not None, None
        if had:
            state["stager"].release()
        return {"discarded": had}


def adapter_request(version: int):
    """The vLLM adapter of a policy version: one name and id per version, so the prefix cache (keyed by
    adapter) never mixes two policies. The path names no file: the tensors are in the worker's memory."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=f"streamrl-v{version}", lora_int_id=version + 1, lora_path=f"streamrl://v{version}")


def _lora_model(manager, lora_id: int, tensors: dict, spec):
    """vLLM's LoRAModel from tensors in memory (what `_load_adapter` builds from a folder)."""
    from vllm.lora.peft_helper import PEFTHelper

    from streamrl.engine.lora import peft_config

    positions = manager.max_position_embeddings
    helper = PEFTHelper.from_dict({**peft_config(spec), "vllm_max_position_embeddings": positions})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    return manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_id,
        tensors={name: t.clone() for name, t in tensors.items()},  # vLLM scales B in place: keep ours as sent
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=lora_mapper(model),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


def lora_mapper(model):
    """The names mapper vLLM's own adapter loader passes for `model`: `get_rename_mapper()` in vLLM 0.32,
    `get_unstacked_mapper()` in 0.25-0.26 (which has no get_rename_mapper: seen on the H200 with 0.25.1)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return None
    for name in ("get_rename_mapper", "get_unstacked_mapper"):
        if hasattr(mapper, name):
            return getattr(mapper, name)()
    return mapper


async def stage_and_swap_async_llm(engine, ready: WeightsReady, keep_kv: bool = False, before_swap=None) -> dict:
    """Stage in every worker (generation goes on), then pause (keep requests) → load → [reset KV] →
    resume. Returns `{"version", "seconds", "swap_s", "nbytes", "phases"}` (`phases`: seconds of
    stage, pause, load, reset, resume); raises `WeightTransferError` when a worker failed (the engine
    keeps generating with the weights it had).

    keep_kv (`rollout.kv_at_swap = "keep"`): the running requests go on over the KV they have (no
    reset, nothing recomputed); new requests never reuse it (their cache salt names their version).
    Otherwise they are preempted and re-prefilled by the new weights.

    LoRA (`ready.adapter`): the version becomes an adapter of its own, loaded without a pause; running
    requests keep the adapter they started with, so no KV is reset.

    before_swap: awaited once the weights are staged, before the swap (the node's evaluation of the live version
    finishes there: rollout/evaluation.py); its wait counts in the stage phase."""
    peer, start = f"learner@{ready.store_host}:{ready.store_port}", time.perf_counter()
    started = await engine.collective_rpc("stage_weights", args=(messages.encode(ready),))
    errors = [r["error"] for r in started if r.get("error")]
    deadline = time.monotonic() + ready.timeout_s + 5.0
    while not errors:
        statuses = await engine.collective_rpc("staged_status")
        errors = [s["error"] for s in statuses if s.get("error")]
        if all(s["version"] == ready.version for s in statuses):
            break
        if time.monotonic() > deadline:
            errors = [f"version {ready.version} not staged within {ready.timeout_s:g} s"]
        await asyncio.sleep(STATUS_POLL_S)
    if errors:
        await engine.collective_rpc("discard_staged")  # workers that did stage free their buffers
        raise WeightTransferError(peer, "staging", f"{len(errors)} worker(s) failed: {errors[0]}")
    if before_swap is not None:
        await before_swap()
    marks = [start, time.perf_counter()]  # then: paused, loaded, reset, resumed
    if ready.adapter is not None:
        results = await _swap(engine, peer)
        loaded = time.perf_counter()
        marks += [marks[-1], loaded, loaded, loaded]  # no pause, nothing reset: the load is the whole swap
        return _swapped(ready, results, marks, paused=False)
    await _pause(engine)
    marks.append(time.perf_counter())
    try:
        results = await _swap(engine, peer)
        marks.append(time.perf_counter())
        if not keep_kv:
            await engine.reset_prefix_cache(reset_running_requests=True)
        marks.append(time.perf_counter())
    finally:
        await engine.resume_generation()
    marks.append(time.perf_counter())
    return _swapped(ready, results, marks, paused=True)


async def _pause(engine) -> None:
    """Pause the scheduler, keeping the requests and their KV; returns once no step is in flight.

    clear_cache=False: a pause would reset the prefix cache and the running requests' KV before the load;
    after it is when that counts (and only without keep_kv). The engine core's own call, not
    `AsyncLLM.pause_generation`, which adds a 20 ms sleep for the order of its log lines (vLLM 0.25-0.32)."""
    core = getattr(engine, "engine_core", None)
    if hasattr(core, "pause_scheduler_async"):
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
    else:
        await engine.pause_generation(mode="keep", clear_cache=False)


async def _swap(engine, peer: str) -> list[dict]:
    results = await engine.collective_rpc("swap_staged")
    errors = [r["error"] for r in results if r.get("error")]
    if errors:
        raise WeightTransferError(peer, "apply", f"{len(errors)}/{len(results)} worker(s) failed: {errors[0]}")
    return results


SWAP_PHASES = ("stage", "pause", "load", "reset", "resume")


def _swapped(ready: WeightsReady, results: list[dict], marks: list[float], paused: bool) -> dict:
    """marks: start, staged, paused, loaded, reset, resumed (perf_counter)."""
    phases = {name: round(b - a, 4) for name, a, b in zip(SWAP_PHASES, marks, marks[1:])}
    swap_s = marks[-1] - marks[1] if paused else 0.0
    return {"version": ready.version, "seconds": marks[-1] - marks[0], "swap_s": swap_s,
            "nbytes": sum(r.get("nbytes", 0) for r in results), "phases": phases}  # fmt: skip


def swap_into_hf_model(model: torch.nn.Module, staged: Staged, peer: str = "learner") -> None:
    """Copy staged tensors into a transformers model's parameters and buffers, in place."""
    targets = model.state_dict()
    for name, tensor in staged.named:
        target = targets.get(name)
        if target is None:
            raise WeightTransferError(peer, "apply", f"tensor {name!r} is not in the model (same architecture?)")
        if target.shape != tensor.shape:
            raise WeightTransferError(
                peer, "apply", f"tensor {name!r} is {list(tensor.shape)}, the model has {list(target.shape)}"
            )
    with torch.no_grad():
        torch._foreach_copy_([targets[name] for name, _ in staged.named], [tensor for _, tensor in staged.named])


def apply_to_hf_model(model: torch.nn.Module, ready: WeightsReady, device: torch.device | str) -> None:
    """Receive and apply in one blocking call (no generation to overlap with): a failed transfer
    changes nothing."""
    stager = Stager(device)
    staged = stager.receive(ready)
    try:
        swap_into_hf_model(model, staged, f"learner@{ready.store_host}:{ready.store_port}")
    finally:
        stager.release()
