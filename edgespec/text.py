"""Streaming-safe detokenization and stop strings."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class StreamDecoder:
    """Token ids → text deltas. A multi-byte UTF-8 character split across tokens is held back
    until it is complete (invalid bytes become U+FFFD, never an exception)."""

    def __init__(self, token_to_bytes: Callable[[int], bytes]) -> None:
        self._piece = token_to_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tokens: Sequence[int]) -> str:
        return self._utf8.decode(b"".join(self._piece(t) for t in tokens))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings in streamed text and holds back any tail that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._text = ""  # text received but not yet released
        self.hit = False

    def push(self, delta: str) -> str:
        """Add new text; return the part that is safe to emit. Sets `hit` at a stop string."""
        self._text += delta
        if not self.stops:
            out, self._text = self._text, ""
            return out
        cut = min((i for i in (self._text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self._text = self._text[:cut], ""
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self._text.endswith(s[:k])), default=0)
        out, self._text = self._text[: len(self._text) - hold], self._text[len(self._text) - hold:]
        return out

    def flush(self) -> str:
        out, self._text = self._text, ""
        return out
