"""The Drafter protocol: propose up to γ tokens after a context.

A drafter sees the whole committed context (prompt + generated tokens, the last one not yet
evaluated by the target) on every call, so it never depends on being told what was accepted:
a drafter with its own KV cache syncs it to the context by common prefix. A drafter bug can only
lower acceptance; verification keeps the output exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from edgespec.sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int]  # x̃₁..x̃γ (may be empty: then the cycle is a plain step)
    q: npt.NDArray[np.float64] | None = None  # (γ, V) processed draft probabilities; None = one-hot


class Drafter(Protocol):
    name: str

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams,
              rng: np.random.Generator) -> Draft:
        """Propose at most `gamma` tokens to follow `context`."""
        ...

    def close(self) -> None: ...
