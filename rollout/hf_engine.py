"""The transformers backend: `generate` with a KV cache, for machines without vLLM and as a parity reference.

Requests that wait while a batch runs are batched together (left-padded) into the next
`generate` call, so several groups in flight share one forward pass per step, as vLLM's
continuous batching would (but only at batch boundaries). On CUDA the cache is static
(FINDINGS: 6x the dynamic cache at batch 256). Behavior logprobs are log_softmax(raw logits / T)
at the sampled token — the same definition as the vLLM backend (rollout/engine.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from streamrl.engine.config import ModelConfig, RolloutConfig
from streamrl.engine.messages import WeightsReady
from streamrl.rollout.engine import Completion, check_sampling


class _Request:
    def __init__(self, prompt_ids: list[int], n: int, max_tokens: int):
        self.prompt_ids, self.n, self.max_tokens = list(prompt_ids), n, max_tokens
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()


class HFEngine:
    """`GenerationEngine` over `transformers` generate; one batch at a time, in a worker thread."""

    def __init__(
        self,
        model_path: str,
        model: ModelConfig,
        rollout: RolloutConfig,
        seed: int = 0,
        device: str = "cpu",
        max_batch: int = 256,
    ):
        import torch

        from streamrl.engine.models import load_model, load_tokenizer

        check_sampling(rollout)
        torch.manual_seed(seed)
        self.rollout, self.device, self.max_batch = rollout, device, max_batch
        self.max_model_len = model.max_model_len
        self.tokenizer = load_tokenizer(model_path, model.trust_remote_code)
        self.model = load_model(model_path, model.dtype, device, model.trust_remote_code)
        self.policy_version = 0
        self.tokens_generated = 0
        self._queue: list[_Request] = []
        self._lock_and_loop: tuple[asyncio.Lock, asyncio.AbstractEventLoop] | None = None
        # Every generate on one thread: on CUDA the static cache runs compiled CUDA graphs, whose
        # state is thread-local (another thread fails in cudagraph_trees with an AssertionError).
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-generate")

    @property
    def _lock(self) -> asyncio.Lock:
        """One generate or weight update at a time; a lock per event loop (asyncio locks are bound to one)."""
        loop = asyncio.get_running_loop()
        if self._lock_and_loop is None or self._lock_and_loop[1] is not loop:
            self._lock_and_loop = (asyncio.Lock(), loop)
        return self._lock_and_loop[0]

    async def generate(self, prompt_ids: list[int], n: int, max_tokens: int) -> list[Completion]:
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room under model.max_model_len = "
                f"{self.max_model_len}; lower data.max_prompt_tokens"
            )
        request = _Request(prompt_ids, n, min(max_tokens, room))
        self._queue.append(request)
        await asyncio.sleep(0)  # let requests submitted in the same tick join this batch
        async with self._lock:
            batch = self._take_batch()
            if batch:
                await self._run(batch)
        return await request.future

    def _take_batch(self) -> list[_Request]:
        batch, rows = [], 0
        while self._queue and (not batch or rows + self._queue[0].n <= self.max_batch):
            request = self._queue.pop(0)
            batch.append(request)
            rows += request.n
        return batch

    async def _run(self, batch: list[_Request]) -> None:
        version = self.policy_version
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._thread, self._generate_batch, batch)
        except Exception as e:  # every waiter learns why
            for request in batch:
                request.future.set_exception(e)
            return
        for request, completions in zip(batch, results):
            for c in completions:
                c.token_versions = [version] * len(c.token_ids)
                self.tokens_generated += len(c.token_ids)
            request.future.set_result(completions)

    def _generate_batch(self, batch: list[_Request]) -> list[list[Completion]]:
        import torch

        rows = [r.prompt_ids for r in batch for _ in range(r.n)]
        input_ids, attention_mask = self._left_pad(rows)
        max_new = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=True,
                max_new_tokens=max_new,
                temperature=self.rollout.temperature,
                top_p=self.rollout.top_p,
                top_k=self.rollout.top_k,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                cache_implementation="static" if self.device.startswith("cuda") else None,
            )
        new_tokens = out.sequences[:, input_ids.shape[1] :]  # [B, T]
        logprobs = torch.stack(out.logits, dim=1).float().div(self.rollout.temperature).log_softmax(-1)  # [B, T, V]
        picked = logprobs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
        results, row = [], 0
        for request in batch:
            results.append(
                [
                    self._completion(new_tokens[row + i].tolist(), picked[row + i].tolist(), request.max_tokens)
                    for i in range(request.n)
                ]
            )
            row += request.n
        return results

    def _left_pad(self, rows: list[list[int]]):
        import torch

        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        return input_ids, attention_mask

    def _completion(self, token_ids: list[int], logprobs: list[float], max_tokens: int) -> Completion:
        """Cut at the first eos (kept, like vLLM does) or at this request's own max_tokens."""
        eos, head = self.tokenizer.eos_token_id, token_ids[:max_tokens]
        end, finish = (head.index(eos) + 1, "stop") if eos in head else (len(head), "length")
        return Completion(token_ids=token_ids[:end], logprobs=logprobs[:end], finish_reason=finish, token_versions=[])

    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """log_softmax(logits / T) of each completion token given what precedes it (teacher-forced)."""
        import torch

        ids = torch.tensor([list(prompt_ids) + list(completion_ids)], device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [T, V]
        logprobs = logits.div(self.rollout.temperature).log_softmax(-1)
        return logprobs.gather(-1, ids[0, len(prompt_ids) :, None]).squeeze(-1).tolist()

    async def update_weights(self, ready: WeightsReady) -> float:
        """Receive `ready` into the model between batches; later batches sample with `ready.version`."""
        from streamrl.rollout.worker_ext import apply_to_hf_model

        start = time.perf_counter()
        async with self._lock:
            await asyncio.to_thread(apply_to_hf_model, self.model, ready, self.device)
            self.policy_version = ready.version
        return time.perf_counter() - start

    async def close(self) -> None:
        self._thread.shutdown(wait=False)
        self.model = None
