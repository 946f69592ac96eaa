"""The Drafter protocol: propose up to γ tokens after a context.

A drafter sees the whole committed context (prompt + generated tokens, the last one not yet
evaluated by the target) on every call, so it never depends on being told what was accepted:
a drafter with its own KV cache syncs it to the context by common prefix. A drafter bug can only
lower acceptance; verification keeps the output exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from edgespec.sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int]  # x̃₁..x̃γ (may be empty: then the cycle is a plain step)
    q: npt.NDArray[np.float64] | None = None  # (γ, V) processed draft probabilities; None = one-hot
    # per token, the drafter's belief that it will be accepted, computed BEFORE the token is drawn
    # (e.g. max q). A rule that verifies x̃ᵢ or not depending on x̃ᵢ itself, such as q(x̃ᵢ), would
    # bias sampled output; one that depends only on what came before is lossless.
    confidence: list[float] | None = None
    synced: int = 0  # context tokens the drafter evaluated to catch up before drafting
    support: int | None = None  # n-gram drafters: how many context tokens the match they copy spans


def confidence(logits: npt.NDArray[np.float32], q: npt.NDArray[np.float64] | None) -> float:
    """A position's confidence, known before its token is drawn (see Draft.confidence): the top
    probability of q when sampling, of the raw softmax of `logits` when greedy (q None)."""
    return float(q.max()) if q is not None else float(1.0 / np.exp(logits - logits.max()).sum())


class Drafter(Protocol):
    name: str

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most `gamma` tokens to follow `context`. A drafter with confidences calls
        `stop(confidences)` once it knows the next position's confidence and before drawing its
        token, and drafts no more when it returns True (the scheduler's marginal gain vs cost rule)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DraftCost:
    """What drafting γ tokens costs: fixed_ms + γ·per_token_ms (γ > 0). A block drafter (`block`)
    computes all its rows in one forward before any confidence is known, so its cost is mostly fixed."""

    fixed_ms: float
    per_token_ms: float
    block: bool = False


def draft_cost_prior(drafter: object) -> DraftCost | None:
    """The drafter's cost prior for the scheduler: its `measure_draft_cost()` when it has one (block
    drafters), else a chain of `measure_ms_per_token()` steps, else None (not measurable here)."""
    measure = getattr(drafter, "measure_draft_cost", None)
    if measure is not None:
        return measure()
    per_token = getattr(drafter, "measure_ms_per_token", None)
    return DraftCost(0.0, per_token()) if per_token is not None else None
