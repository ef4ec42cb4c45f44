"""The reward of examples/gpu-1.5b.toml and gpu-7b-lora.toml: a signal a random model at Qwen2's vocabulary has.

Those examples make random models with Qwen2's 152k-row embedding over the 512-token tokenizer of
`streamrl make-tiny-model` (the LM head's cost is a users' size; the tokenizer is not), so ~997 in 1000 sampled ids
decode to nothing, as Qwen2's own padded ids do, and the `copy` reward is 0 for nearly every sample: groups without
variance train nothing. `decoded_share` is the share of a completion's tokens that decode to text, graded from the
first step (GRPO scales each group by its own spread); `copy` (the F1 of the completion's words against the
prompt's) takes over once they do.
"""

from __future__ import annotations

TOKENIZER_SIZE = 512  # `streamrl make-tiny-model`'s tokenizer, whatever the model's embedding


def decoded_share(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """Per sample: the share of its token ids the tokenizer knows (below TOKENIZER_SIZE); 0.0 for no tokens."""
    return [sum(i < TOKENIZER_SIZE for i in ids) / len(ids) if ids else 0.0 for ids in completion_ids]
