"""The Backend protocol: what the engine and drafters need from a model runtime.

A backend owns one model and one sequence of KV state. Positions are implicit: `eval` appends
tokens at `n_past`, `truncate` rolls back. Logits come back only for the rows asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

# Which logit rows `eval` returns: none, the last one, or one per evaluated token.
LogitRows = Literal["none", "last", "all"]


@runtime_checkable
class Backend(Protocol):
    name: str  # "llama.cpp", "reference", "mlx"
    path: str  # the model file (or a description for in-memory models)
    n_vocab: int
    n_ctx: int
    bos_id: int | None
    eos_id: int | None
    add_bos: bool  # whether tokenize(add_special=True) prepends BOS

    @property
    def n_past(self) -> int:
        """Number of tokens in the KV cache."""
        ...

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def token_to_bytes(self, token: int) -> bytes:
        """Raw bytes of one token's piece (may be a partial UTF-8 sequence). Control tokens give b""."""
        ...

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, <end_of_turn>, ...)."""
        ...

    def eval(self, tokens: Sequence[int], rows: LogitRows = "last") -> npt.NDArray[np.float32]:
        """Append `tokens` at n_past and return logits: (0|1|len(tokens), n_vocab) float32.

        Raises ContextOverflowError if n_past + len(tokens) > n_ctx (nothing is evaluated then).
        """
        ...

    def truncate(self, n_past: int) -> None:
        """Roll the KV cache back to its first `n_past` tokens."""
        ...

    def vocab_fingerprint(self) -> VocabInfo:
        """What llama.cpp's draft/target compatibility rule compares."""
        ...

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as a string (e.g. tokenizer.chat_template), or None."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class VocabInfo:
    """Vocabulary facts for draft/target compatibility (llama.cpp common/speculative.cpp's rule)."""

    vocab_type: int
    n_vocab: int
    add_bos: bool
    bos_id: int | None
    add_eos: bool
    eos_id: int | None
    token_text: Callable[[int], str]  # id -> the token's text as stored in the vocabulary
