"""What a vLLM request returns, collected into a `Completion`: its tokens, the processed logprob of each and the
policy version each was made under (rollout/backends/vllm.py says which version a token is stamped with, and
whether a request's outputs come once or streamed step by step)."""

from __future__ import annotations

from streamrl.rollout.backends.protocol import Completion


class Collector:
    """Accumulates the streamed deltas of one sample."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason = ""

    def add(self, output, version: int) -> None:
        """`version`: the engine's when the delta arrived (full weights), or the request's adapter's (LoRA).

        Flat logprobs (`flat_logprobs=True`) hold one entry a position with `logprobs=0`, the sampled token's:
        its list is taken whole, with no object made per token (this runs for every token the node makes)."""
        new_ids = list(output.token_ids)
        positions = output.logprobs
        if positions is None or len(positions) != len(new_ids):
            raise RuntimeError(
                f"vLLM returned {len(new_ids)} tokens but {0 if positions is None else len(positions)} logprob entries"
            )
        flat = getattr(positions, "logprobs", None)  # FlatLogprobs: one list of floats for every entry
        if flat is not None and len(flat) == len(new_ids) and positions.token_ids == new_ids:
            self.logprobs += flat
        else:
            self.logprobs += [position[token].logprob for token, position in zip(new_ids, positions)]
        self.token_ids += new_ids
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
