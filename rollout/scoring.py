"""The node's rewards: groups that finish together are scored in one call.

A node's groups finish in bursts (every group admitted at once runs the same `max_tokens`; with vLLM each
group's outputs come in one piece when it ends). Scored one group a call, each took a thread hop and a reward
pool round trip, one after the other under the scorer's lock, and each hop waited for the GIL that vLLM's front
end (in the node's process) holds most of the time: a burst of 120 groups at the 0.5B shape took the node's
round past the engine's last token by a few tenths of a second. Here one thread scores everything queued since
its last call in one `Scorer.score` (the samples of all those groups, each with its own prompt and row), while
the next groups queue.
"""

from __future__ import annotations

import asyncio
import dataclasses

from streamrl.engine.config import DataConfig
from streamrl.rollout.backends.protocol import Completion
from streamrl.rollout.sources import Prompt, prompt_text


@dataclasses.dataclass
class _Group:
    prompt: Prompt
    completions: list[Completion]
    done: asyncio.Future


class GroupScorer:
    """`await score(prompt, completions)`: the group's rewards (None where a reward failed), from a batch of every
    group queued meanwhile. A group whose completions cannot be decoded fails alone; a scorer that raises fails
    every group of its batch."""

    def __init__(self, scorer, tokenizer, data: DataConfig):
        self.scorer, self.tokenizer, self.data = scorer, tokenizer, data
        self._queued: list[_Group] = []
        self._worker: asyncio.Task | None = None
        self.calls = 0  # Scorer.score calls made (a batch each)

    async def score(self, prompt: Prompt, completions: list[Completion]) -> list[float | None]:
        group = _Group(prompt, completions, asyncio.get_running_loop().create_future())
        self._queued.append(group)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain(), name="score-groups")
        return await group.done

    async def _drain(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            batch = [g for g in batch if not g.done.done()]  # a group cancelled while queued
            try:
                results = await asyncio.to_thread(self._score, batch)
            except Exception as e:  # noqa: BLE001 - handed to every group of the batch
                results = [e] * len(batch)
            for group, result in zip(batch, results):
                if group.done.done():
                    continue
                if isinstance(result, BaseException):
                    group.done.set_exception(result)
                else:
                    group.done.set_result(result)

    def _score(self, batch: list[_Group]) -> list[list[float | None] | Exception]:
        """In a thread: decode each group (one that fails gets its exception), then one call for the rest."""
        prompts, texts, ids, rows, spans = [], [], [], [], []
        results: list[list[float | None] | Exception] = []
        for group in batch:
            tokens = [c.token_ids for c in group.completions]
            try:
                decoded = [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
            except Exception as e:  # noqa: BLE001 - this group's failure
                results.append(e)
                continue
            spans.append((len(results), len(texts), len(tokens)))
            results.append([])
            texts += decoded
            ids += tokens
            prompts += [prompt_text(group.prompt, self.data)] * len(tokens)
            rows += [group.prompt.row] * len(tokens)
        if texts:
            self.calls += 1
            rewards = self.scorer.score(prompts, texts, ids, rows)
            for slot, start, n in spans:
                results[slot] = rewards[start : start + n]
        return results
