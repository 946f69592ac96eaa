"""The Backend protocol: what the engine and drafters need from a model runtime.

A backend owns one model and one sequence of KV state. Positions are implicit: `eval` appends
tokens at `n_past`, `truncate` rolls back. Logits come back only for the rows asked for.

A recurrent or hybrid model (Mamba-2, LFM2's short convolutions, linear attention) keeps a state that
cannot be cut back to an earlier position. Such a backend says `recurrent = True`; its `truncate`
returns to the last `checkpoint()` and re-evaluates the tokens from there (StateCheckpoint), so the
engine, calibration and drafters roll back the same way on every model: checkpoint before tokens
that may be rolled back, truncate after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from edgespec.errors import BackendError, ContextOverflowError

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
    threads: int  # CPU threads it computes with (0: chosen by the runtime, or in-process numpy)
    recurrent: bool  # some layers keep a state `truncate` can only restore from a checkpoint

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

    def eval_argmax(self, tokens: Sequence[int]) -> npt.NDArray[np.int64]:
        """Append `tokens` like `eval(tokens, rows="all")` and return each row's argmax: the greedy
        next token after each, (len(tokens),), without handing the rows over (llama.cpp: read in
        its own output buffer, not copied; MLX: taken on the device, only the ids cross). Raises
        ContextOverflowError as `eval` does."""
        ...

    def truncate(self, n_past: int) -> None:
        """Roll the KV cache back to its first `n_past` tokens. A recurrent backend restores its last
        checkpoint (taken at or before `n_past`) and re-evaluates up to `n_past`; to 0 always works.
        BackendError when it cannot."""
        ...

    def checkpoint(self) -> None:
        """Remember the state at n_past, so that `truncate` can come back to any position from here
        on. A no-op where `truncate` rolls back anywhere (recurrent is False)."""
        ...

    @property
    def checkpoint_at(self) -> int | None:
        """Where the last checkpoint was taken (None: none, or recurrent is False): a recurrent
        backend's `truncate` goes back to positions at or after it, and to 0."""
        ...

    def vocab_fingerprint(self) -> VocabInfo:
        """What llama.cpp's draft/target compatibility rule compares."""
        ...

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as a string (e.g. tokenizer.chat_template), or None."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class FeatureBackend(Backend, Protocol):
    """A target that also keeps hidden states at a few layers for every evaluated token: what feature
    heads read (EAGLE-3, DFlash, DSpark; drafters.heads checks a target against it before a head drafts).
    llama_features.LlamaFeatureBackend, mlx_features.MlxFeatureBackend and reference.ReferenceFeatureBackend."""

    feature_layers: tuple[int, ...]  # target layer ids; a feature = the INPUT of that layer
    n_embd: int  # the target's hidden size H: a feature row is len(feature_layers) * n_embd wide

    def features(self, start: int = 0, stop: int | None = None) -> npt.NDArray[np.float32]:
        """Features of positions [start, stop) (default: all n_past): (stop - start, len(feature_layers) * n_embd)."""
        ...

    def token_embeddings(self) -> Any | None:
        """The target's token embeddings (V, H) in the backend's own array type, or None when the
        backend holds no weights a head can borrow (then read them from the target's GGUF)."""
        ...

    def lm_head_weights(self) -> Any | None:
        """The target's LM head (V, H) in the backend's own array type (the tied embeddings if tied),
        or None as for ``token_embeddings``."""
        ...


def check_room(n_past: int, n: int, n_ctx: int) -> None:
    """ContextOverflowError unless `n` more tokens fit after `n_past` in a context of `n_ctx`."""
    if n_past + n > n_ctx:
        raise ContextOverflowError(f"{n_past} tokens in context + {n} new exceed the context of {n_ctx} tokens")


def join_rows(parts: list[npt.NDArray[np.float32]], n_vocab: int) -> npt.NDArray[np.float32]:
    """The logit rows of a chunked eval as one (rows, n_vocab) array (no copy for a single chunk)."""
    if not parts:
        return np.empty((0, n_vocab), np.float32)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


class StateCheckpoint:
    """A recurrent backend's one checkpoint: the saved state, the position it was taken at, and the
    tokens evaluated since (what a rollback re-evaluates). The backend saves and restores its own
    state; this keeps the bookkeeping (and the one error) the same for llama.cpp, MLX and numpy."""

    def __init__(self) -> None:
        self.state: Any = None
        self.at = -1  # -1: none taken
        self.tokens: list[int] = []

    def take(self, state: Any, n_past: int) -> None:
        self.state, self.at, self.tokens = state, n_past, []

    def evaluated(self, tokens: Sequence[int]) -> None:
        """`tokens` were appended to the state (call from eval)."""
        if self.at >= 0:
            self.tokens.extend(int(t) for t in tokens)

    def replay(self, n_past: int, n: int) -> list[int]:
        """The tokens to re-evaluate after restoring the checkpoint to get from it to `n` (of
        `n_past` now); BackendError if no checkpoint was taken at or before `n`. The caller then
        restores `state` and evaluates them (eval records them again: the checkpoint stays usable)."""
        if self.at < 0 or n < self.at:
            where = "none was taken" if self.at < 0 else f"the last one is at {self.at}"
            raise BackendError(f"cannot roll a recurrent state back from {n_past} to {n} tokens: it needs a "
                               f"checkpoint at or before {n} and {where}")
        replay, self.tokens = self.tokens[:n - self.at], []
        return replay

    @property
    def position(self) -> int | None:
        """`at`, None when no checkpoint was taken (Backend.checkpoint_at)."""
        return self.at if self.at >= 0 else None

    def clear(self) -> None:
        self.state, self.at, self.tokens = None, -1, []


_C = TypeVar("_C", bound="Closing")


class Closing:
    """``close()`` at garbage collection and at the end of a ``with`` block; close() must be safe to
    call twice and on a half-built object (an __init__ that raised)."""

    def close(self) -> None:
        """Free what the object holds (nothing here)."""

    def __del__(self) -> None:
        self.close()

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
