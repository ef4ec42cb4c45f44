"""The transformers backend: `generate` with a KV cache, for machines without vLLM and as a parity reference.

Requests that wait while a batch runs are batched together (left-padded) into the next
`generate` call, so several groups in flight share one forward pass per step, as vLLM's
continuous batching would (but only at batch boundaries). On CUDA the cache is static
(FINDINGS: 6x the dynamic cache at batch 256), and transformers compiles the decode step and records
CUDA graphs for the shape it sees, reusing its cache (and so the graphs) only while the shape stays
the same: every batch is padded to `max_batch` rows, prompts to `data.max_prompt_tokens` (rounded up to a
multiple of `WIDTH_STEP`; a longer prompt, as a multi-turn episode's can be, to its own multiple), new tokens
always `rollout.max_tokens` (a decode step at this size is latency-bound: 16 rows cost about what 256
do), a batch waits up to `FILL_S` for requests to fill it, and `warm_up` compiles that shape before the
node registers, so nothing compiles mid-run. (Seen on H200s with rows bucketed to powers of two: each
change of batch size cost a new cache and graphs, and generation ran at 2.2k instead of ~30k tok/s.)
Behavior logprobs are those of the distribution generate sampled from: the log-softmax of its processed
scores (logits / T, top-k and top-p filtered) at the sampled token — the same definition as the vLLM backend's
(rollout/backends/protocol.py). `_SampledLogprobs`, the last logits processor, takes it one step at a time:
`output_scores` kept every step's scores to the end, rows x max_tokens x vocabulary floats (23 GiB at 256 rows,
160 tokens and Qwen2's 152k vocabulary: out of memory on an H100). Sampling is the run's config and nothing
else: the model's own generation_config (a hub model's repetition_penalty, its top_k) is replaced at load, as
vLLM's SamplingParams leave it out.

Weights: a new version is received into staging buffers while a batch runs (`weights.Stager`, in a
thread of its own) and swapped into the model between batches, on the generation thread itself. LoRA:
a version is its adapter's tensors, copied into PEFT layers injected into the model with the first one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time

from streamrl.engine import lora
from streamrl.engine.config import LoraConfig, ModelConfig, RolloutConfig
from streamrl.engine.lora import linear_modules as lora_modules
from streamrl.engine.lora import resolve as lora_spec
from streamrl.engine.messages import AdapterSpec, WeightsReady
from streamrl.engine.placement import HF_GPU_ROWS
from streamrl.engine.weights import Staged, Stager
from streamrl.rollout.backends.protocol import BackendClock, Completion, LiveVersion

log = logging.getLogger("streamrl.rollout")

WIDTH_STEP = 64  # prompt widths are padded to a multiple of this on CUDA
FILL_S = 0.25  # on CUDA a batch waits this long at most for requests to fill it


class _SampledLogprobs:
    """The last logits processor of a generate call: each step's log-softmax of the processed scores, kept
    only until the next step's input shows the token drawn from it; `result` gathers the last step's."""

    def __init__(self) -> None:
        self._pending = None  # [rows, vocab] of the step whose token is not drawn yet
        self._steps: list = []  # [rows] per step: the drawn token's logprob

    def __call__(self, input_ids, scores):
        self._take(input_ids[:, -1])
        self._pending = scores.float().log_softmax(-1)
        return scores

    def _take(self, drawn) -> None:
        if self._pending is not None:
            self._steps.append(self._pending.gather(-1, drawn[:, None]).squeeze(-1))
            self._pending = None

    def result(self, sequences):
        """[rows, new tokens]: each drawn token's logprob (`sequences`: generate's output, prompt included)."""
        import torch

        self._take(sequences[:, -1])
        return torch.stack(self._steps, dim=1)


def _sampling_processors(rollout: RolloutConfig) -> list:
    """transformers' own warpers for the run's temperature, top-k and top-p, in generate's order; generate
    itself is given T = 1, top_k = 0, top_p = 1 so it adds none after the recorder."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    processors = [TemperatureLogitsWarper(rollout.temperature)] if rollout.temperature != 1.0 else []
    if rollout.top_k > 0:
        processors.append(TopKLogitsWarper(top_k=rollout.top_k))
    if rollout.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=rollout.top_p))
    return processors


class _Request:
    def __init__(self, prompt_ids: list[int], n: int, max_tokens: int, sampling: RolloutConfig | None = None):
        self.prompt_ids, self.n, self.max_tokens = list(prompt_ids), n, max_tokens
        self.sampling = sampling  # None: the run's; else an evaluation's (batched only with its like)
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()


class HFBackend:
    """`GenerationBackend` over `transformers` generate; one batch at a time, in a worker thread."""

    @property
    def policy_version(self) -> int:
        return self.live.version

    def __init__(
        self,
        model_path: str,
        model: ModelConfig,
        rollout: RolloutConfig,
        seed: int = 0,
        device: str = "cpu",
        max_batch: int = HF_GPU_ROWS,
        static: bool | None = None,
        max_prompt_tokens: int = WIDTH_STEP,
        lora: LoraConfig | None = None,
    ):
        """static: bucketed shapes and a static (compiled) cache; default on CUDA. max_prompt_tokens: the
        prompt width every static batch is padded to (rounded up to a multiple of `WIDTH_STEP`). lora
        (enabled): PEFT layers injected now, before anything is compiled, each version copied into them."""
        import torch

        from streamrl.engine.models import load_model, load_tokenizer

        torch.manual_seed(seed)
        if device.startswith("cuda") and rollout.gpu_memory_gib > 0:  # its share of a GPU it may share
            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, rollout.gpu_memory_gib * 2**30 / total), device)
        self.rollout, self.device, self.max_batch = rollout, device, max_batch
        self.max_model_len = model.max_model_len
        self.static = device.startswith("cuda") if static is None else static
        self.width = _round_up(max(max_prompt_tokens, 1), WIDTH_STEP)
        self.tokenizer = load_tokenizer(model_path, model.trust_remote_code)
        self.model = load_model(model_path, model.dtype, device, model.trust_remote_code)
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig(  # the run's sampling only (see the module's doc)
            eos_token_id=self.tokenizer.eos_token_id, pad_token_id=self.tokenizer.pad_token_id, do_sample=True
        )
        self.live = LiveVersion()
        self.tokens_generated = 0
        self.clock = BackendClock()
        self.stager = Stager(device)
        self.before_swap = None  # awaited between staging a version and swapping it in (rollout/evaluation.py)
        self._adapter_spec: AdapterSpec | None = None  # LoRA: the adapter injected
        if lora is not None and lora.enabled:
            self._inject(lora_spec(lora, lora_modules(self.model)))
        self._queue: list[_Request] = []
        self._lock_and_loop: tuple[asyncio.Lock, asyncio.AbstractEventLoop] | None = None
        # Every generate and every swap on one thread: on CUDA the static cache runs compiled CUDA
        # graphs, whose state is thread-local (another thread fails in cudagraph_trees with an
        # AssertionError); and a swap queued here runs between two batches, never during one.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-generate")

    @property
    def _lock(self) -> asyncio.Lock:
        """One batch at a time; a lock per event loop (asyncio locks are bound to one)."""
        loop = asyncio.get_running_loop()
        if self._lock_and_loop is None or self._lock_and_loop[1] is not loop:
            self._lock_and_loop = (asyncio.Lock(), loop)
        return self._lock_and_loop[0]

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], n: int, max_tokens: int, sampling: RolloutConfig | None = None
    ) -> list[Completion]:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room under model.max_model_len = "
                f"{self.max_model_len}; lower data.max_prompt_tokens"
            )
        request = _Request(prompt_ids, n, min(max_tokens, room), sampling)
        self._queue.append(request)
        await asyncio.sleep(0)  # let requests submitted in the same tick join this batch
        async with self._lock:
            if self.static:  # a batch costs about the same at any size: fill it first
                deadline = time.monotonic() + FILL_S
                while self._queued_rows() < self.max_batch and time.monotonic() < deadline and self._queue:
                    await asyncio.sleep(0.01)
            batch = self._take_batch()
            if batch:
                await self._run(batch)
        return await request.future

    def _queued_rows(self) -> int:
        return sum(r.n for r in self._queue)

    def _take_batch(self) -> list[_Request]:
        batch, rows = [], 0
        while self._queue and (not batch or rows + self._queue[0].n <= self.max_batch):
            if batch and self._queue[0].sampling != batch[0].sampling:  # one sampling per generate call
                break
            request = self._queue.pop(0)
            batch.append(request)
            rows += request.n
        return batch

    async def _run(self, batch: list[_Request]) -> None:
        try:
            version, results = await asyncio.get_running_loop().run_in_executor(
                self._thread, self._generate_batch, batch
            )
        except Exception as e:  # every waiter learns why
            for request in batch:
                request.future.set_exception(e)
            return
        for request, completions in zip(batch, results):
            for c in completions:
                c.token_versions = [version] * len(c.token_ids)
                self.tokens_generated += len(c.token_ids)
            request.future.set_result(completions)

    def _generate_batch(self, batch: list[_Request]) -> tuple[int, list[list[Completion]]]:
        """(the policy version that generated it, each request's completions); on the generation thread."""
        import torch
        from transformers import LogitsProcessorList

        rows = [r.prompt_ids for r in batch for _ in range(r.n)]
        version, used = self.policy_version, len(rows)
        sampling = batch[0].sampling or self.rollout
        input_ids, attention_mask = self._left_pad(self._bucket_rows(rows))
        max_new = self.rollout.max_tokens if self.static else max(r.max_tokens for r in batch)
        recorder = _SampledLogprobs()
        self.clock.begin()
        try:
            with torch.inference_mode():
                sequences = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    do_sample=True,
                    max_new_tokens=max_new,
                    temperature=1.0,  # the run's sampling is in the processors, the recorder last
                    top_p=1.0,
                    top_k=0,
                    logits_processor=LogitsProcessorList([*_sampling_processors(sampling), recorder]),
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.tokenizer.eos_token_id,
                    cache_implementation="static" if self.static else None,
                )
            picked = recorder.result(sequences)[:used].tolist()  # [B, T], -inf where top-k/top-p cut
            new_tokens = sequences[:used, input_ids.shape[1] :].tolist()  # [B, T]
        finally:
            self.clock.end()
        results, row = [], 0
        for request in batch:
            results.append(
                [self._completion(new_tokens[row + i], picked[row + i], request.max_tokens) for i in range(request.n)]
            )
            row += request.n
        return version, results

    def _bucket_rows(self, rows: list[list[int]]) -> list[list[int]]:
        """On CUDA, rows padded (with copies of the first, dropped afterwards) to `max_batch`: one shape."""
        if not self.static:
            return rows
        return rows + [rows[0]] * (max(self.max_batch, len(rows)) - len(rows))

    def _left_pad(self, rows: list[list[int]]):
        import torch

        width = max(map(len, rows))
        if self.static:
            width = max(_round_up(width, WIDTH_STEP), self.width)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        return input_ids, attention_mask

    def _completion(self, token_ids: list[int], logprobs: list[float], max_tokens: int) -> Completion:
        """Cut at the first eos (kept, like vLLM does) or at this request's own max_tokens."""
        eos, head = self.tokenizer.eos_token_id, token_ids[:max_tokens]
        end, finish = (head.index(eos) + 1, "stop") if eos in head else (len(head), "length")
        return Completion(token_ids=token_ids[:end], logprobs=logprobs[:end], finish_reason=finish, token_versions=[])

    async def warm_up(self) -> float:
        """Compile the decode step for the bucketed shapes before serving (CUDA); the seconds it took."""
        if not self.static:
            return 0.0
        start, prompt = time.perf_counter(), [self.tokenizer.eos_token_id]
        # the serving shape (every batch is padded to it), twice: compile, then record and replay the graphs
        shapes = [(self.max_batch, self.width), (self.max_batch, self.width)]
        for rows, width in shapes:
            batch = [_Request(prompt * width, 1, self.rollout.max_tokens) for _ in range(rows)]
            shape_start = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(self._thread, self._generate_batch, batch)
            log.info("warm-up: %d rows x %d prompt tokens in %.1f s", rows, width, time.perf_counter() - shape_start)
        self.clock = BackendClock()  # warm-up is not generation
        return time.perf_counter() - start

    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """Each completion token's logprob under the sampling distribution (engine/sampling.py) given what
        precedes it (teacher-forced); -inf for a token that distribution filters out."""
        import torch

        from streamrl.engine.sampling import processed_logprobs

        ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]  # [T, V]
        r = self.rollout
        logprobs = processed_logprobs(logits, r.temperature, r.top_k, r.top_p)
        return logprobs.gather(-1, ids[0, len(prompt_ids) :, None]).squeeze(-1).tolist()

    # ---- weights ----------------------------------------------------------------------------

    async def update_weights(self, ready: WeightsReady) -> float:
        """Receive `ready` into staging while batches run, then swap it in between two batches; later
        batches sample with `ready.version`. The seconds from the layout to live."""
        start = time.perf_counter()
        staged = await asyncio.to_thread(self.stager.receive, ready)
        if self.before_swap is not None:
            await self.before_swap()
        await asyncio.get_running_loop().run_in_executor(self._thread, self._swap, staged, ready)
        return time.perf_counter() - start

    def _swap(self, staged: Staged, ready: WeightsReady) -> None:
        from streamrl.rollout.backends.vllm_worker import swap_into_hf_model

        start = time.perf_counter()
        try:
            if ready.adapter is not None:  # LoRA: the adapter's tensors into the model's PEFT layers
                self._inject(ready.adapter)
                staged = dataclasses.replace(staged, named=[(lora.param_name(n), t) for n, t in staged.named])
            swap_into_hf_model(self.model, staged, f"learner@{ready.store_host}:{ready.store_port}")
            if self.device.startswith("cuda"):
                import torch

                # the copies are done before the next batch reads the weights, and before the staging
                # buffers, released below, take the next version (on a stream of its own)
                torch.cuda.synchronize(self.device)
            self.live.went_live(staged.version)
        finally:
            self.stager.release()
            self.clock.swapped(time.perf_counter() - start)

    def _inject(self, spec: AdapterSpec) -> None:
        """PEFT's LoRA layers (adapter `default`) in the model, once (B = 0: the base model until the first
        version): every version is copied into them at a batch boundary, so a batch samples from one version."""
        if self._adapter_spec == spec:
            return
        if self._adapter_spec is not None:
            raise ValueError(f"adapter {spec} differs from the one this node serves ({self._adapter_spec})")
        from peft import LoraConfig as PeftLoraConfig
        from peft import inject_adapter_in_model

        config = PeftLoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.target_modules))
        inject_adapter_in_model(config, self.model, adapter_name=lora.ADAPTER)
        dtype = next(self.model.parameters()).dtype
        for name, param in self.model.named_parameters():
            if lora.is_adapter(name):  # in the served dtype, where PEFT made them fp32
                param.data = param.data.to(dtype)
        self.model.eval()
        self._adapter_spec = spec

    async def close(self) -> None:
        self._thread.shutdown(wait=False)
        self.model = None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
