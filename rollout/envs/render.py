"""Chat-template rendering one turn at a time: token ids for what is new, never earlier turns re-tokenized.

Re-rendering a whole conversation after every turn and tokenizing it again changes earlier tokens
(BPE merges across the boundary, templates that drop reasoning from past assistant turns), so the
learner would train on tokens the model never sampled. Instead the episode keeps the sampled ids
as they are, and after each model turn appends the ids of one piece of text: what the template
puts after an assistant message's content when these observation messages follow it, up to the
next generation prompt. That piece is cut from the template's own rendering of a fixed
conversation `[user, assistant(SENTINEL)] + observation`, so it carries the template's turn
markers (Qwen: `<|im_end|>\\n<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`).

When the model ended its turn with the template's own end-of-turn token (Qwen's `<|im_end|>` is a
stop token), that token is not added a second time. A tokenizer without a chat template gets the
observation's text as is.
"""

from __future__ import annotations

from streamrl.rollout.envs.protocol import Message

SENTINEL = "STREAMRL_TURN_SENTINEL"
_BASE = [{"role": "user", "content": "STREAMRL_BASE_USER"}]


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be rendered one turn at a time; the message says why."""


class TurnRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        if self.templated:
            self.observation_ids([{"role": "user", "content": "probe"}], [])  # fail at start, not mid-run

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def first_prompt(self, messages: list[Message], tools: list | None = None) -> list[int]:
        """The episode's first prompt, with the generation prompt that opens the model's turn."""
        if not self.templated:
            return self._encode("\n".join(m["content"] for m in messages))
        kwargs = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self._encode(text)

    def observation_ids(self, messages: list[Message], last_model_ids: list[int]) -> list[int]:
        """Ids that close the model's turn, hold `messages` and open the model's next turn."""
        if not self.templated:
            text = "\n".join(m["content"] for m in messages)
            return self._encode("\n" + text + "\n") if text else []
        conversation = [*_BASE, {"role": "assistant", "content": SENTINEL}, *messages]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        if text.count(SENTINEL) != 1:
            raise TemplateError(
                "the tokenizer's chat template does not render an assistant message's content once "
                f"({text.count(SENTINEL)} times in a probe); multi-turn episodes need one that does"
            )
        ids = self._encode(text[text.index(SENTINEL) + len(SENTINEL) :])
        return ids[self._already_closed(ids, last_model_ids) :]

    def _already_closed(self, ids: list[int], last_model_ids: list[int]) -> int:
        """How many leading ids the model's turn already ends with (its own end-of-turn special token)."""
        for k in (2, 1):
            head = ids[:k]
            if len(head) == k and head[0] in self._special and last_model_ids[-k:] == head:
                return k
        return 0
