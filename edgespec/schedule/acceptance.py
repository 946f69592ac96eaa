"""What the scheduler learns of a drafter's acceptance: per-position conditional rates (`Acceptance`)
and the calibration of a drafter's own confidence (`Calibration`), both from decayed counts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgespec.schedule.costs import K_MAX


class Acceptance:
    """a_i = P(draft i accepted | drafts before it were), from exponentially decayed counts with a
    prior; a position not yet seen borrows its predecessor's estimate as its prior."""

    def __init__(self, prior: float = 0.5, strength: float = 1.0, decay: float = 0.8) -> None:
        self.hits, self.tries = [0.0] * K_MAX, [0.0] * K_MAX
        self.prior, self.strength, self.decay = prior, strength, decay
        self._rates: list[float] | None = None

    def observe(self, drafted: int, accepted: int) -> None:
        """A verified draft: positions 1..accepted passed, accepted+1 (if drafted) failed."""
        for i in range(min(accepted + 1, drafted)):
            self.observe_position(i, i < accepted)

    def observe_position(self, i: int, ok: float) -> None:
        """Position i+1 was judged (its predecessors having passed): ok is 1/0, or the chance it passed."""
        self.hits[i] = self.decay * self.hits[i] + ok
        self.tries[i] = self.decay * self.tries[i] + 1
        self._rates = None

    @property
    def rates(self) -> list[float]:
        if self._rates is None:
            out, prev = [], self.prior
            for h, n in zip(self.hits, self.tries):
                prev = (h + self.strength * prev) / (n + self.strength)
                out.append(prev)
            self._rates = out
        return self._rates


class Calibration:
    """P(accept | the drafter's confidence c) in 10 bins of c: decayed counts with prior c."""

    def __init__(self, strength: float = 4.0, decay: float = 0.98) -> None:
        self.hits, self.tries = np.zeros(10), np.zeros(10)
        self.strength, self.decay = strength, decay

    def __call__(self, c: float, prior: float | None = None) -> float:
        """P(accept | c): the bin's counts, with `prior` (default c) worth `strength` of them."""
        b = min(int(c * 10), 9)
        return (self.hits[b] + self.strength * (c if prior is None else prior)) / (self.tries[b] + self.strength)

    def observe(self, confidence: Sequence[float], accepted: int) -> None:
        for i, c in enumerate(confidence[: accepted + 1]):
            b = min(int(c * 10), 9)
            self.hits[b] = self.decay * self.hits[b] + (i < accepted)
            self.tries[b] = self.decay * self.tries[b] + 1


class Shadows:
    """Drafts that were not verified (a free drafter's, at plain steps), each scored against the
    tokens the target emits as verification would have judged it. A draft leaves at its first miss or
    its end, so at most K_MAX − 1 are live."""

    def __init__(self) -> None:
        self.live: list[tuple[list[int], int]] = []  # (draft, tokens of it matched so far)

    def add(self, tokens: list[int]) -> None:
        self.live.append((tokens, 0))

    def score(self, tok: int, probs=None, seen=None) -> bool | None:
        """Score every live draft's next token against the emitted `tok`, oldest first; `seen(i,
        credit)` gets each judged position i with its credit: 1/0, or with `probs` (the target's
        processed row) p(x̃), the chance verification accepts x̃. Returns whether the newest draft's
        token was right (None: no live draft)."""
        live, hit = [], None
        for draft, i in self.live:
            hit = tok == draft[i]
            if seen is not None:
                seen(i, float(probs[draft[i]]) if probs is not None else float(hit))
            if hit and i + 1 < len(draft):
                live.append((draft, i + 1))
        self.live = live
        return hit
