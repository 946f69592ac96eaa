"""The batch-1 scheduler (`-k auto`): how many tokens to draft and verify, cycle by cycle.

Each cycle takes the γ (0 = a plain step) with the most expected tokens per second,

    rate(γ) = E[tokens | γ] / (T_draft(γ) + T_verify(γ + 1)),    E[tokens | γ] = 1 + S₁ + … + S_γ,

where S_i, the chance that drafts 1..i are all accepted, is the product of per-position conditional
acceptance rates learned online, or of the drafter's calibrated confidences for tokens already
drafted (DSpark's survival product). Costs start from the cost profile and follow the cycles
actually timed. When no γ > 0 wins, plain steps run and learning goes on: a free drafter (n-gram)
drafts in shadow and is scored against what the target emits next; a costly one is probed on a
small time budget.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from edgespec.drafters.base import Draft, Drafter
from edgespec.sampling import SamplingParams

K_MAX = 16  # most tokens one verification pass checks (γ ≤ K_MAX − 1)
FREE_DRAFT = 0.05  # a drafter costing under this fraction of T(1) per token drafts in shadow
PROBE_BUDGET = 0.01  # share of plain-step time a costly drafter may lose on probes (halved per failed one)
PROBE_ACCEPTANCE = 0.9  # a probe drafts what would win at this acceptance


def best_gamma(survival: Sequence[float], t_draft: Sequence[float], t_verify: Sequence[float],
               lo: int = 0) -> tuple[int, float]:
    """argmax_γ of (1 + Σ_{i≤γ} S_i) / (t_draft[γ] + t_verify[γ+1]) for lo ≤ γ ≤ len(survival),
    and that rate in tokens per unit of time. t_draft[0] is a plain step's (0), t_verify[k] is
    T(k) (index 0 unused)."""
    best, best_rate, tokens = lo, -1.0, 1.0 + sum(survival[:lo])
    for g in range(lo, len(survival) + 1):
        if g > lo:
            tokens += survival[g - 1]
        rate = tokens / (t_draft[g] + t_verify[g + 1])
        if rate > best_rate:
            best, best_rate = g, rate
    return best, best_rate


class RobustTime:
    """An EMA of running medians: one slow outlier moves nothing, a lasting shift moves it within a
    few samples."""

    def __init__(self, window: int = 5, beta: float = 0.3) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.beta, self.value, self.n = beta, 0.0, 0

    def add(self, x: float) -> None:
        self.samples.append(x)
        m = statistics.median(self.samples)
        self.value = m if self.n == 0 else self.value + self.beta * (m - self.value)
        self.n += 1


class CostModel:
    """T_verify(k) for k = 1..K_MAX and a drafter's ms per draft token, in ms.

    Measured k follow their own timings; unmeasured ones are the prior (profile) times a shared
    scale, the robust mean ratio of measured to prior, so a machine that slows down slows them all."""

    def __init__(self, t_forward_ms: dict[int, float], draft_per_token_ms: float = 0.0) -> None:
        ks = sorted(t_forward_ms)
        self.prior = [0.0] + [float(np.interp(k, ks, [t_forward_ms[j] for j in ks])) if k <= ks[-1]
                              else t_forward_ms[ks[-1]] * k / ks[-1] for k in range(1, K_MAX + 1)]
        self.verify = [RobustTime() for _ in range(K_MAX + 1)]
        self.scale = RobustTime(window=9, beta=0.2)
        self.draft_prior = draft_per_token_ms
        self.draft = RobustTime()

    def observe_verify(self, k: int, ms: float) -> None:
        self.verify[k].add(ms)
        self.scale.add(ms / self.prior[k])

    def observe_draft(self, n_tokens: int, ms: float) -> None:
        self.draft.add(ms / n_tokens)

    def t_verify(self) -> list[float]:
        scale = self.scale.value if self.scale.n else 1.0
        return [v.value if v.n else p * scale for v, p in zip(self.verify, self.prior)]

    def t_draft(self) -> list[float]:
        per_token = self.draft.value if self.draft.n else self.draft_prior
        return [g * per_token for g in range(K_MAX)]


class Acceptance:
    """a_i = P(draft i accepted | drafts before it were), from exponentially decayed counts with a
    prior; a position not yet seen borrows its predecessor's estimate as its prior."""

    def __init__(self, prior: float = 0.5, strength: float = 1.0, decay: float = 0.9) -> None:
        self.hits, self.tries = np.zeros(K_MAX), np.zeros(K_MAX)
        self.prior, self.strength, self.decay = prior, strength, decay
        self.rates = self._rates()

    def observe(self, drafted: int, accepted: int) -> None:
        reached = min(accepted + 1, drafted)  # positions 1..accepted+1 were judged
        self.hits[:reached] = self.decay * self.hits[:reached] + (np.arange(reached) < accepted)
        self.tries[:reached] = self.decay * self.tries[:reached] + 1
        self.rates = self._rates()

    def _rates(self) -> list[float]:
        out, prev = [], self.prior
        for h, n in zip(self.hits, self.tries):
            prev = (h + self.strength * prev) / (n + self.strength)
            out.append(prev)
        return out


class Calibration:
    """P(accept | the drafter's confidence c) in 10 bins of c: decayed counts with prior c."""

    def __init__(self, strength: float = 4.0, decay: float = 0.98) -> None:
        self.hits, self.tries = np.zeros(10), np.zeros(10)
        self.strength, self.decay = strength, decay

    def __call__(self, c: float) -> float:
        b = min(int(c * 10), 9)
        return (self.hits[b] + self.strength * c) / (self.tries[b] + self.strength)

    def observe(self, confidence: Sequence[float], accepted: int) -> None:
        for i, c in enumerate(confidence[: accepted + 1]):
            b = min(int(c * 10), 9)
            self.hits[b] = self.decay * self.hits[b] + (i < accepted)
            self.tries[b] = self.decay * self.tries[b] + 1


@dataclass
class Decision:
    """What one cycle was planned to give (for stats: predicted vs measured speed)."""

    gamma: int = 0
    tokens: float = 1.0  # expected tokens emitted
    ms: float = 0.0  # expected cost
    probe: bool = False
    seconds: float = 0.0  # time the decision itself took (plan + cut, not drafting)


@dataclass
class Scheduler:
    """Per cycle: `draft()` plans γ, drafts, and cuts the draft to the best verify length;
    `observe()` learns from the verified cycle; `emitted()` scores a shadow draft."""

    cost: CostModel
    acceptance: Acceptance = field(default_factory=Acceptance)
    calibration: Calibration = field(default_factory=Calibration)
    _shadow: list[int] = field(default_factory=list)  # unverified draft being scored
    _shadow_seen: int = 0  # how many of its tokens matched so far
    _plain_ms: float = 0.0  # plain-step time since the last probe
    _backoff: float = 1.0  # each failed probe doubles the wait for the next
    _probing: bool = False

    @property
    def free(self) -> bool:
        return self.cost.t_draft()[1] < FREE_DRAFT * self.cost.t_verify()[1]

    def draft(self, drafter: Drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator) -> tuple[Draft, Decision]:
        """Draft for one cycle; at most `limit` (< K_MAX) tokens are kept."""
        t0 = time.perf_counter()
        limit = min(limit, K_MAX - 1)
        t_draft, t_verify = self.cost.t_draft(), self.cost.t_verify()
        a = self.acceptance.rates
        gamma, _ = best_gamma(np.cumprod(a[:limit]).tolist(), t_draft, t_verify)
        probe = False
        if gamma == 0 and limit > 0 and not self.free:
            gamma = self._probe_gamma(limit, t_draft, t_verify)
            probe = gamma > 0
        self._probing = probe
        shadow = gamma == 0 and limit > 0 and self.free and not self._shadow
        seconds = time.perf_counter() - t0
        if gamma == 0 and not shadow:
            return Draft([]), Decision(ms=t_verify[1], seconds=seconds)

        def stop(conf: Sequence[float]) -> bool:  # conf[-1]: the next position, not drawn yet
            return self._cut(conf, len(conf), gamma, t_draft, t_verify)[0] < len(conf)

        d = drafter.draft(context, gamma or limit, params, rng, stop=stop if gamma and not probe else None)
        t1 = time.perf_counter()
        if shadow:
            self._shadow, self._shadow_seen = d.tokens[:limit], 0
            d = Draft([])
        if d.tokens and not probe and (params.greedy or d.q is None):
            # a deterministic draft may be cut after the fact; a sampled one may not (its tokens
            # would decide their own verification), so the stop rule above did its cutting
            g, tokens = self._cut(d.confidence, len(d.tokens), min(gamma, len(d.tokens)), t_draft, t_verify)
        else:
            g = len(d.tokens)
            tokens = 1.0 + float(np.cumprod(self._survival(d.confidence, g)[:g]).sum())
        d = replace(d, tokens=d.tokens[:g], q=None if d.q is None else d.q[:g],
                    confidence=None if d.confidence is None else d.confidence[:g])
        seconds += time.perf_counter() - t1
        return d, Decision(g, tokens, t_draft[g] + t_verify[g + 1], probe, seconds)

    def observe(self, draft: Draft, accepted: int, t_draft: float, t_verify: float, catch_up: bool) -> None:
        """Learn from a verified cycle (times in seconds); `catch_up`: the draft time included
        re-syncing the drafter after plain steps, so it says nothing about per-token cost."""
        g = len(draft.tokens)
        self.cost.observe_verify(g + 1, t_verify * 1000)
        if g:
            if not catch_up:
                self.cost.observe_draft(g, t_draft * 1000)
            self.acceptance.observe(g, accepted)
            if draft.confidence is not None:
                self.calibration.observe(draft.confidence, accepted)
            if self._probing:
                self._backoff = 1.0 if accepted == g else min(64.0, 2 * self._backoff)
            self._plain_ms = 0.0
        else:
            self._plain_ms += t_verify * 1000

    def emitted(self, tokens: Sequence[int]) -> None:
        """Score a pending shadow draft against tokens the target emitted (greedy: exactly what
        verification would have accepted; sampled: accepted with the same probability, p(x̃))."""
        for tok in tokens:
            if not self._shadow:
                return
            if tok != self._shadow[self._shadow_seen]:
                self._resolve(self._shadow_seen + 1, self._shadow_seen)
                return
            self._shadow_seen += 1
            if self._shadow_seen == len(self._shadow):
                self._resolve(self._shadow_seen, self._shadow_seen)
                return

    def forget_shadow(self) -> None:
        self._shadow, self._shadow_seen = [], 0

    # -- internals --------------------------------------------------------------------------------

    def _resolve(self, drafted: int, accepted: int) -> None:
        self.acceptance.observe(drafted, accepted)
        self.forget_shadow()

    def _survival(self, confidence: Sequence[float] | None, n: int) -> list[float]:
        """Conditional acceptance for positions 1..K: calibrated confidence for the first n drafted
        tokens when the drafter gives it, the learned per-position rates after."""
        a = list(self.acceptance.rates)
        if confidence is not None:
            a[:n] = [self.calibration(c) for c in confidence[:n]]
        return a

    def _cut(self, confidence: Sequence[float] | None, n: int, most: int, t_draft: Sequence[float],
             t_verify: Sequence[float]) -> tuple[int, float]:
        """Best γ ≤ `most` once n tokens are drafted (their cost is spent whatever γ verifies):
        returns (γ, expected tokens)."""
        s = np.cumprod(self._survival(confidence, n)[:most]).tolist()
        g, _ = best_gamma(s, [t_draft[max(g, n)] for g in range(most + 1)], t_verify)
        return g, 1.0 + sum(s[:g])

    def _probe_gamma(self, limit: int, t_draft: Sequence[float], t_verify: Sequence[float]) -> int:
        """A probe's γ if its turn has come: what would win at PROBE_ACCEPTANCE, once plain steps
        have run long enough that the probe's expected loss fits PROBE_BUDGET of their time."""
        opt = np.cumprod([PROBE_ACCEPTANCE] * limit).tolist()
        g, _ = best_gamma(opt, t_draft, t_verify)
        g = max(g, 1)
        s = np.cumprod(self.acceptance.rates[:g]).sum()
        loss = t_draft[g] + t_verify[g + 1] - (1.0 + s) * t_verify[1]
        budget = PROBE_BUDGET if best_gamma(opt, t_draft, t_verify)[0] > 0 else PROBE_BUDGET / 10
        return g if self._plain_ms * budget >= loss * self._backoff else 0
