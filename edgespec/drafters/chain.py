"""Drafter chains: `--drafter ngram,model` (any list of drafter specs) behind one Drafter.

llama.cpp (common/speculative.cpp, `common_speculative_draft` over the configured types, e.g.
`--spec-type ngram-mod,draft-mtp`) asks its drafters in order and verifies the first non-empty
draft. A chain does exactly that at a fixed γ (`DrafterChain.draft`). Under `-k auto`,
edgespec.schedule.chain.ChainScheduler picks the member proposal with the best expected rate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgespec.drafters.base import Draft, DraftCost, Drafter
from edgespec.sampling import SamplingParams


class DrafterChain:
    """Several drafters behind one (the members, in the order named). At a fixed γ the first non-empty
    draft is verified (llama.cpp's rule); under `-k auto`, ChainScheduler chooses per cycle."""

    def __init__(self, members: Sequence[Drafter]) -> None:
        if len(members) < 2:
            raise ValueError(f"a chain needs at least two drafters (got {len(members)})")
        self.members = tuple(members)
        self.name = ",".join(m.name for m in self.members)
        self.paths = tuple(p for m in self.members for p in m.paths)

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        for m in self.members:
            d = m.draft(context, gamma, params, rng, stop)
            if d.tokens:
                return d
        return Draft([])

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost | None:
        """None: a chain is priced member by member (Pricing.calibrate)."""
        return None

    def reset(self) -> None:
        for m in self.members:
            m.reset()

    def clear(self) -> None:
        """Forget every earlier generation in every member that remembers (the bench's cold start)."""
        for m in self.members:
            clear = getattr(m, "clear", None)
            if clear is not None:
                clear()

    def close(self) -> None:
        for m in self.members:
            m.close()


def members(drafter: Drafter | None) -> tuple[Drafter, ...]:
    """A chain's members, or the drafter itself (none for None)."""
    if drafter is None:
        return ()
    return drafter.members if isinstance(drafter, DrafterChain) else (drafter,)
