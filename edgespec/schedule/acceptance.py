"""What the scheduler learns of a drafter's acceptance: per-position conditional rates (`Acceptance`)
and the calibration of a drafter's own confidence (`Calibration`), both from decayed counts; the
scoring of drafts nobody verified (`Shadows`); and all it knows of one (target, drafter) pair,
with a belief in its acceptance across generations (`Learned`)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from edgespec.schedule.costs import K_MAX, token_sums


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
        """A verified chain: its first `accepted` tokens passed, the next (if drafted) failed."""
        for i, c in enumerate(confidence[: accepted + 1]):
            self.observe_one(c, i < accepted)

    def observe_one(self, c: float, ok: bool) -> None:
        b = min(int(c * 10), 9)
        self.hits[b] = self.decay * self.hits[b] + ok
        self.tries[b] = self.decay * self.tries[b] + 1


class SiblingRates:
    """h_j = P(the j-th sibling drawn beside a sampled chain token is accepted | that token and the j − 1
    siblings drawn before it were rejected), j = 1, 2, …: decayed counts per rank (the last rank
    pools the deeper ones) with a prior worth `strength` of them (schedule.trees prices sampled side
    trees with it)."""

    def __init__(self, strength: float = 4.0, decay: float = 0.98) -> None:
        self.hits, self.tries = np.zeros(K_MAX), np.zeros(K_MAX)
        self.strength, self.decay = strength, decay

    def __call__(self, j: int, prior: float) -> float:
        """h_j, starting from `prior` while rank j has few outcomes."""
        b = min(j, K_MAX) - 1
        return (self.hits[b] + self.strength * prior) / (self.tries[b] + self.strength)

    def observe(self, j: int, ok: bool) -> None:
        b = min(j, K_MAX) - 1
        self.hits[b] = self.decay * self.hits[b] + ok
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


PRIOR = 0.5  # a pair never seen: its acceptance estimate starts here ...
STRENGTH = 4.0  # ... worth this many verified positions (so are a pair's record and each generation's start)
RECENT = 0.1  # weight of the newest first-token outcome in the recent hit rate
_GRID = (np.arange(256) + 0.5) / 256  # acceptance values the belief is integrated over
_LOG_GRID, _LOG_MISS, _GRID_SUMS = np.log(_GRID), np.log1p(-_GRID), token_sums(_GRID, K_MAX - 1)


class Learned:
    """What the scheduler knows of one (target, drafter) pair's acceptance:
    - `belief()`: Beta(α, β) over every verified position: the pair's record (`prior`, the acceptance
      it showed in earlier engines; None: never seen) or PRIOR, worth STRENGTH positions, plus every
      position judged since (`judged`: [passed, judged]);
    - per-position conditional rates (`acceptance`), restarted from the belief's mean each generation;
    - this generation's recent first-token hit rate (`recent`) and current run of right drafts (`run`);
    - the calibration of the drafter's own confidences, and the shadow drafts still being scored."""

    def __init__(self, prior: float | None = None) -> None:
        self.prior = prior
        self.judged = [0.0, 0.0]
        self.run = 0
        self.calibration = Calibration()
        self.shadows = Shadows()
        self._before = (0.0, 0.0)  # `judged` when the current generation began
        self.start()

    @property
    def fresh(self) -> bool:
        """Nothing is known of the pair: no record, no position judged."""
        return self.prior is None and not self.judged[1]

    def belief(self) -> tuple[float, float]:
        """(α, β): the record (or PRIOR) worth STRENGTH positions, plus every position judged since (a
        record from other texts yields to this engine's evidence within a few dozen positions)."""
        p0 = PRIOR if self.prior is None else self.prior
        return self.judged[0] + STRENGTH * p0, self.judged[1] - self.judged[0] + STRENGTH * (1.0 - p0)

    def mean(self) -> float:
        """The pair's expected acceptance."""
        a, b = self.belief()
        return a / (a + b)

    def expected_gain(self, speedup: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> tuple[float, float]:
        """E[max(g − 1, 0)] over the belief in the acceptance a, g = speedup(a, costs.token_sums(a, K_MAX
        − 1)): what speculation is expected to add once found; and E[a | g > 1], the acceptance the
        pair has if it wins."""
        a, b = self.belief()
        logw = (a - 1.0) * _LOG_GRID + (b - 1.0) * _LOG_MISS
        w = np.exp(logw - logw.max())
        w /= w.sum()
        g = speedup(_GRID, _GRID_SUMS)
        win = w * (g > 1.0)
        if win.sum() <= 0:
            return 0.0, 0.0
        return float(np.sum(w * np.maximum(g - 1.0, 0.0))), float(np.sum(win * _GRID) / win.sum())

    def start(self) -> None:
        """The per-position rates and the recent hit rate start from the belief's mean."""
        self.recent = p0 = self.mean()
        self.acceptance = Acceptance(p0, strength=STRENGTH)

    def new_generation(self, costly: bool) -> None:
        """Pending shadow drafts and the run are dropped; a costly drafter's rates start again from
        the belief (one bad stretch must not switch it off)."""
        self.shadows, self.run, self._before = Shadows(), 0, (self.judged[0], self.judged[1])
        if costly:
            self.start()

    def generation_judged(self) -> tuple[float, float]:
        """Verified draft positions since `new_generation`: (passed, judged), the pair's record."""
        return self.judged[0] - self._before[0], self.judged[1] - self._before[1]

    def observe(self, drafted: int, accepted: int, confidence: Sequence[float] | None, scored: bool) -> None:
        """A verified draft of `drafted` tokens, `accepted` of them accepted; `scored`: its positions
        are judged here (False: a free drafter's, scored in shadow). A draft cut to nothing counts
        as a first-token miss in the recent rate."""
        if scored:
            self.acceptance.observe(drafted, accepted)
            self.judged[0] += accepted
            self.judged[1] += min(accepted + 1, drafted)
            self.run = self.run + drafted if drafted and accepted == drafted else 0
            self.recent += RECENT * ((accepted > 0) - self.recent)
        if confidence is not None:
            self.calibration.observe(confidence, accepted)

    def emitted(self, tokens: Sequence[int], probs: Sequence | None = None) -> None:
        """Score the shadow drafts against tokens the target emitted (Shadows.score)."""
        for j, tok in enumerate(tokens):
            hit = self.shadows.score(tok, None if probs is None else probs[j], self._shadow_seen)
            if hit is not None:
                self.run = self.run + 1 if hit else 0

    def survival(self, confidence: Sequence[float] | None, n: int, sampled: bool) -> list[float]:
        """S_i for i = 1..K_MAX − 1: calibrated confidence for the first n drafted tokens when the
        drafter gives it (`sampled`: a bin not yet seen starts from the position's rate), the learned
        rates after (the first capped by the recent hit rate)."""
        a = list(self.acceptance.rates)
        a[0] = min(a[0], self.recent)
        if confidence is not None:  # the first n, or as many as there are (the rest: learned rates)
            n = min(n, len(confidence))
            a[:n] = [self.calibration(c, a[i] if sampled else None) for i, c in enumerate(confidence[:n])]
        return list(accumulate(a, operator.mul))

    def _shadow_seen(self, i: int, credit: float) -> None:
        self.acceptance.observe_position(i, credit)
        if i == 0:
            self.recent += RECENT * (credit - self.recent)
