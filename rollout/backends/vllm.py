"""The vLLM backend: AsyncLLM with continuous batching, token ids in and out, per-token policy versions.

Behavior logprobs (vLLM 0.32): `logprobs_mode = "processed_logprobs"`, the log-softmax of the logits after
temperature and top-k/top-p masking, i.e. of the distribution the token was sampled from (without filters:
log_softmax(logits / T)); the learner recomputes the same (rollout/backends/protocol.py). Only the
sampled token's logprob is requested (`logprobs=0`). On CUDA that mode keeps vLLM off FlashInfer's
sampler (which cannot return processed logprobs) and on its torch one.

Per-token versions: outputs stream as deltas and each delta's tokens are stamped with the
engine's `policy_version` when the delta arrives. `update_weights` pauses generation keeping the
running requests, applies the weights, resets the running requests' KV cache so every later token
is computed by the new weights, bumps the version, then resumes.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import uuid

from streamrl.engine.config import ModelConfig, RolloutConfig
from streamrl.engine.messages import WeightsReady
from streamrl.engine.workers.lifeline import children_die_with_me
from streamrl.rollout.backends.protocol import BackendClock, Completion, LiveVersion
from streamrl.rollout.backends.vllm_support import check_servable

log = logging.getLogger(__name__)

WORKER_EXTENSION = "streamrl.rollout.backends.vllm_worker.WeightReceiverExtension"


LOGPROBS_MODE = "processed_logprobs"  # of the distribution sampled from, whatever the sampling settings


def engine_args(model_path: str, model: ModelConfig, rollout: RolloutConfig, seed: int, device: str):
    from vllm.engine.arg_utils import AsyncEngineArgs

    extra = {}
    if device == "cpu":
        extra["kv_cache_memory_bytes"] = int(rollout.kv_cache_gib * (1 << 30))
    else:
        extra["gpu_memory_utilization"] = rollout.gpu_memory_utilization
        if rollout.gpu_memory_gib > 0:  # its share in GiB, as vLLM takes it: a fraction of the whole GPU
            import torch

            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
            extra["gpu_memory_utilization"] = min(1.0, rollout.gpu_memory_gib * 2**30 / total)
    if importlib.util.find_spec("streamrl.rollout.backends.vllm_worker") is not None:
        extra["worker_extension_cls"] = WORKER_EXTENSION
    return AsyncEngineArgs(
        model=model_path,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        seed=seed,
        enforce_eager=rollout.enforce_eager,
        trust_remote_code=model.trust_remote_code,
        logprobs_mode=LOGPROBS_MODE,
        disable_log_stats=True,
        **extra,
    )


class _Collector:
    """Accumulates the streamed deltas of one sample."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason = ""

    @property
    def policy_version(self) -> int:
        return self.live.version

    def add(self, output, version: int) -> None:
        new_ids = list(output.token_ids)
        if output.logprobs is None or len(output.logprobs) != len(new_ids):
            raise RuntimeError(
                f"vLLM returned {len(new_ids)} tokens but "
                f"{0 if output.logprobs is None else len(output.logprobs)} logprob entries"
            )
        self.token_ids += new_ids
        self.logprobs += [position[token].logprob for token, position in zip(new_ids, output.logprobs)]
        self.versions += [version] * len(new_ids)
        if output.finish_reason:
            self.finish_reason = output.finish_reason

    def build(self) -> Completion:
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or "length",
            token_versions=self.versions,
        )


class VLLMBackend:
    """`GenerationBackend` over vLLM's AsyncLLM (engine core in its own process, which dies with this one)."""

    def __init__(self, model_path: str, model: ModelConfig, rollout: RolloutConfig, seed: int = 0, device: str = "cpu"):
        check_servable(model_path, model, device)  # before vLLM's import: a few seconds, not a dead engine later
        from vllm.v1.engine.async_llm import AsyncLLM

        self.rollout, self.max_model_len = rollout, model.max_model_len
        self.live = LiveVersion()
        self.tokens_generated = 0
        self.clock = BackendClock()
        self.staging_bytes = 0
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        children_die_with_me()  # the engine core is our child: a killed node must not leave it orphaned
        self._engine = AsyncLLM.from_engine_args(engine_args(model_path, model, rollout, seed, device))

    def _params(self, n: int, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=self.rollout.temperature,
            top_p=self.rollout.top_p,
            top_k=self.rollout.top_k,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
        )

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int) -> list[Completion]:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room under model.max_model_len = "
                f"{self.max_model_len}; lower data.max_prompt_tokens"
            )
        samples = [_Collector() for _ in range(n)]
        request_id = f"{self._prefix}-{next(self._ids)}"
        stream = self._engine.generate(
            {"prompt_token_ids": list(prompt_ids)}, self._params(n, min(max_tokens, room)), request_id
        )
        self.clock.begin()
        try:
            async for out in stream:
                version = self.policy_version
                for output in out.outputs:
                    samples[output.index].add(output, version)
                    self.tokens_generated += len(output.token_ids)
        finally:
            self.clock.end()
        return [s.build() for s in samples]

    async def update_weights(self, ready: WeightsReady) -> float:
        """Stage `ready` in the workers while generation goes on, then pause (keep requests), load,
        reset KV and resume (worker_ext); the seconds from the layout to live.

        The version is bumped once that returns: a token computed in the instant between resume
        and the bump is stamped with the old version, which only overstates its staleness.
        """
        from streamrl.rollout.backends.vllm_worker import stage_and_swap_async_llm

        done = await stage_and_swap_async_llm(self._engine, ready)
        self.live.went_live(ready.version)
        self.clock.swapped(done["swap_s"])
        self.staging_bytes = done["nbytes"]
        return done["seconds"]

    async def warm_up(self) -> float:
        """Nothing to compile ahead (enforce_eager, or vLLM's own capture at start)."""
        return 0.0

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
