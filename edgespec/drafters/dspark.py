"""DSpark drafting: a DFlash block plus a Markov head that conditions each row on the token drafted
before it, and a confidence head (edgespec.heads.dspark).

One block forward gives every row's base logits z_r and hidden h_r (DFlashDrafter's pairing of rows
with positions and its context sync are reused unchanged); the drafts are then chained left to
right: row r adds the Markov bias of prev_r (the anchor for r = 1, else the token drafted at row
r−1: the argmax when greedy, the sample when sampling), so q_r is the processed distribution of
x̃_r given x̃_{<r} and verifying with those q rows is exact speculative sampling. A head with a
confidence head reports conf_r (the chance x̃_r is accepted given x̃_{<r} were) as the draft's
confidence, which is what the scheduler's `stop` rule reads; it depends on x̃_{<r} only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import FeatureBackend
from edgespec.drafters.dflash import DFlashDrafter, DFlashRunner
from edgespec.heads.dspark import MarkovHead

F32 = npt.NDArray[np.float32]


class DSparkRunner(DFlashRunner, Protocol):
    """A DFlash runner that also gives a block's base logits (no Markov bias) and normed hiddens:
    heads.dflash_mlx.MlxDFlashHead, heads.dflash_llama.LlamaDFlashHead opened with the Markov head, or the
    tests' numpy oracle."""

    def forward_block(self, tokens: Sequence[int]) -> tuple[F32, F32]: ...


@runtime_checkable
class ChainedBlockRunner(Protocol):
    """A DSpark runner whose block rows already carry llama.cpp's greedy-chain Markov bias
    (heads.dflash_llama.LlamaDFlashHead): it returns them with the chain they were biased by."""

    def chained_block(self, tokens: Sequence[int]) -> tuple[F32, F32, list[int]]: ...


class DSparkDrafter(DFlashDrafter):
    """Chain drafting with a DSpark head (see the module docstring).

    Args:
        head: the DFlash backbone (its ``forward_block`` logits are the unbiased z_r).
        target: the feature target, as for DFlashDrafter.
        markov: the head's Markov (and confidence) head.
        path: the head file.
    """

    name = "dspark"
    head: DSparkRunner

    def __init__(self, head: DSparkRunner, target: FeatureBackend, markov: MarkovHead, path: str = "") -> None:
        super().__init__(head, target, path)
        self.markov = markov

    def _rows(self, anchor: int, n: int) -> Callable[[int, int], tuple[F32, float | None]]:
        tokens = self.head.block_tokens(anchor, n + 1)
        if isinstance(self.head, ChainedBlockRunner):  # libllama rows carry llama.cpp's chain bias: swap it where prev differs
            z, h, chain = self.head.chained_block(tokens)
            return lambda i, prev: (self.markov.apply(z[i + 1], prev, old=chain[i]), self.markov.confidence(h[i + 1], prev))
        z, h = self.head.forward_block(tokens)  # (n+1, V) base logits, (n+1, H)
        return lambda i, prev: (self.markov.apply(z[i + 1], prev), self.markov.confidence(h[i + 1], prev))
