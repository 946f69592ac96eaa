"""The text-level API over an engine's stream of chunks: what a generation yields and returns, whole
generations, and conversations rendered with the target's chat template."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgespec.stats import Stats


@dataclass(frozen=True)
class Chunk:
    """One streamed piece of a generation (one speculative cycle's worth of tokens)."""

    text: str  # new text (may be "" while a UTF-8 character or a possible stop string is held back)
    tokens: list[int]
    from_draft: list[bool]  # per token: True if it was a draft token the target accepted
    finish_reason: str | None = None  # set on the last chunk: "eos", "length", "stop", "cancelled"


@dataclass
class Generation:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats = field(default_factory=Stats)


class Generating:
    """`generate`, `chat` and `stream_chat`, built on the subclass's `stream` (edgespec.engine.Engine)."""

    target: Any
    last_stats: Stats | None
    stream: Callable[..., Iterator[Chunk]]  # the subclass's

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, **kwargs) -> Generation:
        """Generate a completion. Takes the same keyword arguments as `stream`.

        Returns:
            Generation with the text, token ids, finish_reason and stats.
        """
        text, tokens, reason = [], [], "length"
        for chunk in self.stream(prompt, max_tokens=max_tokens, **kwargs):
            text.append(chunk.text)
            tokens.extend(chunk.tokens)
            reason = chunk.finish_reason or reason
        assert self.last_stats is not None
        return Generation("".join(text), tokens, reason, self.last_stats)

    def stream_chat(self, messages: list[dict], **kwargs) -> Iterator[Chunk]:
        """Stream a reply to a conversation, rendered with the model's chat template (sandboxed).

        Args:
            messages: [{"role": ..., "content": ...}, ...].
            **kwargs: as for `stream` (max_tokens, temperature, ...).
        """
        text, add_bos = self.chat_prompt(messages)
        yield from self.stream(text, parse_special=True, add_special=add_bos, **kwargs)

    def chat(self, messages: list[dict], **kwargs) -> Generation:
        """Like `generate`, for a conversation (see `stream_chat`)."""
        text, add_bos = self.chat_prompt(messages)
        return self.generate(text, parse_special=True, add_special=add_bos, **kwargs)

    def chat_prompt(self, messages: list[dict]) -> tuple[str, bool]:
        """The conversation as prompt text, and whether to add BOS (edgespec.chat.chat_prompt)."""
        from edgespec.chat import chat_prompt

        return chat_prompt(self.target, messages)


def cut(emitted: list[int], generated: int, max_tokens: int, is_eog: Any) -> tuple[list[int], str | None]:
    """`emitted` cut at end-of-generation or the token limit, and why it was cut (None: it was not)."""
    for i, tok in enumerate(emitted):
        if is_eog(tok):
            return emitted[:i], "eos"
        if generated + i + 1 >= max_tokens:
            return emitted[: i + 1], "length"
    return emitted, None
