"""A tiny numpy language model whose next-token distribution is known exactly.

The oracle for losslessness tests: logits depend on the last two tokens through seeded tables,
so any sequence's probability can be enumerated, and 10⁵ generations take seconds. Token i is
the letter chr(ord('a') + i); tokenize maps letters back.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import LogitRows, StateCheckpoint, VocabInfo
from edgespec.errors import BackendError, ContextOverflowError


class ReferenceBackend:
    """The oracle model (module docstring). `recurrent=True` makes it behave as a recurrent model
    does for rollback: `truncate` returns only to the last `checkpoint()` and re-evaluates from there
    (base.StateCheckpoint), so engine tests cover that path in milliseconds."""

    name = "reference"

    def __init__(self, n_vocab: int = 8, seed: int = 0, scale: float = 1.5, n_ctx: int = 512,
                 eos_id: int | None = None, recurrent: bool = False,
                 _tables: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        if not 2 <= n_vocab <= 26:
            raise ValueError(f"n_vocab must be in [2, 26] (got {n_vocab})")
        rng = np.random.default_rng(seed)
        self.w1, self.w2 = _tables or (rng.normal(0, scale, (n_vocab, n_vocab)),
                                       rng.normal(0, scale / 2, (n_vocab + 1, n_vocab)))
        self.path = f"reference(n_vocab={n_vocab}, seed={seed})"
        self.n_vocab, self.n_ctx = n_vocab, n_ctx
        self.bos_id, self.eos_id, self.add_bos = None, eos_id, False
        self.threads = 0  # numpy, in-process
        self.recurrent = recurrent
        self._tokens: list[int] = []
        self._checkpoint = StateCheckpoint()
        self.n_evals = 0  # forward passes, for tests
        self.n_replayed = 0  # tokens re-evaluated by recurrent rollbacks, for tests

    def perturbed(self, eps: float, seed: int = 1) -> ReferenceBackend:
        """A same-vocabulary model with tables moved by eps·N(0,1): a drafter of tunable quality."""
        rng = np.random.default_rng(seed)
        tables = (self.w1 + eps * rng.normal(size=self.w1.shape), self.w2 + eps * rng.normal(size=self.w2.shape))
        return ReferenceBackend(self.n_vocab, n_ctx=self.n_ctx, eos_id=self.eos_id, recurrent=self.recurrent,
                                _tables=tables)

    def next_logits(self, context: Sequence[int]) -> npt.NDArray[np.float32]:
        """Exact next-token logits (V,) after `context` (which must be non-empty)."""
        prev2 = context[-2] if len(context) >= 2 else self.n_vocab  # row n_vocab = "no token"
        return (self.w1[context[-1]] + self.w2[prev2]).astype(np.float32)

    @property
    def n_past(self) -> int:
        return len(self._tokens)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        ids = [ord(c) - ord("a") for c in text]
        bad = [c for c, i in zip(text, ids) if not 0 <= i < self.n_vocab]
        if bad:
            raise BackendError(f"reference vocabulary has letters a..{chr(ord('a') + self.n_vocab - 1)} (got {bad[0]!r})")
        return ids

    def token_to_bytes(self, token: int) -> bytes:
        return b"" if token == self.eos_id else chr(ord("a") + token).encode()

    def is_eog(self, token: int) -> bool:
        return token == self.eos_id

    def eval(self, tokens: Sequence[int], rows: LogitRows = "last") -> npt.NDArray[np.float32]:
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"{self.n_past} + {len(tokens)} tokens exceed the context of {self.n_ctx}")
        start = len(self._tokens)
        self._tokens.extend(int(t) for t in tokens)
        if self.recurrent:
            self._checkpoint.evaluated(tokens)
        self.n_evals += 1
        want = {"none": range(0), "last": range(len(self._tokens) - 1, len(self._tokens)),
                "all": range(start, len(self._tokens))}[rows]
        out = np.empty((len(want), self.n_vocab), np.float32)
        for r, i in enumerate(want):
            out[r] = self.next_logits(self._tokens[: i + 1])
        return out

    def eval_argmax(self, tokens: Sequence[int]) -> npt.NDArray[np.int64]:
        return np.argmax(self.eval(tokens, rows="all"), axis=1)

    @property
    def checkpoint_at(self) -> int | None:
        return self._checkpoint.position

    def truncate(self, n_past: int) -> None:
        if not self.recurrent or n_past >= self.n_past:
            del self._tokens[n_past:]
        elif n_past == 0:
            self._tokens = []
            self._checkpoint.clear()
        else:
            replay = self._checkpoint.replay(self.n_past, n_past)
            self._tokens = list(self._checkpoint.state)  # the state as it was at the checkpoint
            self.n_replayed += len(replay)
            self.eval(replay, rows="none")

    def checkpoint(self) -> None:
        if self.recurrent:
            self._checkpoint.take(tuple(self._tokens), self.n_past)

    def vocab_fingerprint(self) -> VocabInfo:
        return VocabInfo(0, self.n_vocab, False, None, False, self.eos_id, lambda i: chr(ord("a") + i))

    def metadata(self, key: str) -> str | None:
        return None

    def close(self) -> None:
        self._tokens = []


class ReferenceFeatureBackend(ReferenceBackend):
    """A ReferenceBackend that also keeps "target features" for feature-head drafters (a base.FeatureBackend).

    Row p of `features()` belongs to the token at position p: three blocks of n_vocab + 1 values,
    [one-hot of c_p; one-hot of c_{p-1} (index n_vocab: no token); next_logits(c_0..c_p), 0], i.e.
    everything the next-token distribution depends on, so that a head can be built by hand.
    """

    feature_layers = (1, 2, 3)  # nominal: three blocks, as EAGLE-3 reads three layers

    def __init__(self, n_vocab: int = 8, seed: int = 0, **kwargs) -> None:
        super().__init__(n_vocab, seed, **kwargs)
        self.n_embd = n_vocab + 1  # H_t, the width of one block

    def features(self, start: int = 0, stop: int | None = None) -> npt.NDArray[np.float32]:
        """Features of positions [start, stop) (default: all n_past): (stop - start, 3 · (n_vocab + 1))."""
        stop = self.n_past if stop is None else stop
        if not 0 <= start <= stop <= self.n_past:
            raise IndexError(f"feature rows [{start}, {stop}) outside the {self.n_past} evaluated")
        w = self.n_embd
        out = np.zeros((stop - start, 3 * w), np.float32)
        for r, p in enumerate(range(start, stop)):
            out[r, self._tokens[p]] = 1.0
            out[r, w + (self._tokens[p - 1] if p > 0 else self.n_vocab)] = 1.0
            out[r, 2 * w:2 * w + self.n_vocab] = self.next_logits(self._tokens[: p + 1])
        return out

    def token_embeddings(self) -> None:
        """None: the reference model has no token embeddings a head could borrow (base.FeatureBackend)."""
        return None

    def lm_head_weights(self) -> None:
        """None, as for ``token_embeddings``."""
        return None
