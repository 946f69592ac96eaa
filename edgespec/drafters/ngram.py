"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's
suffix n-gram (llama.cpp's ngram-simple, HF's prompt lookup). Deterministic, so q is one-hot."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgespec.drafters.base import Draft
from edgespec.sampling import SamplingParams


class NgramDrafter:
    """Tries suffix n-grams from `n_max` down to `n_min` tokens; the most recent match wins.
    No match drafts nothing, and the engine takes a plain step."""

    name = "ngram"

    def __init__(self, n_max: int = 4, n_min: int = 2) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max (got n_min={n_min}, n_max={n_max})")
        self.n_max, self.n_min = n_max, n_min

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        return Draft(self.lookup(np.asarray(context, dtype=np.int64), gamma))

    def lookup(self, ctx: np.ndarray, gamma: int) -> list[int]:
        """The ≤ gamma tokens that followed the latest earlier match of ctx's suffix n-gram."""
        L = ctx.shape[0]
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = ctx[L - n:]
            # starts s < L - n of windows ctx[s:s+n] equal to the suffix, checked one column at a time
            starts = np.flatnonzero(ctx[: L - n] == suffix[0])
            for j in range(1, n):
                starts = starts[ctx[starts + j] == suffix[j]]
            if starts.size:
                s = int(starts[-1]) + n  # continuation begins right after the match
                return ctx[s: min(s + gamma, L)].tolist()
        return []

    def close(self) -> None:
        pass
