"""The batch-1 scheduler (`-k auto`): how many tokens to draft and verify, cycle by cycle.

Each cycle takes the γ (0: a plain step) with the most expected tokens per ms (edgespec.schedule.rate),

    rate(γ) = (1 + S₁ + … + S_γ) / (T_draft(γ) + T_verify(γ + 1) + E[rollback | γ]),

S_i being the chance that drafts 1..i all pass: a product of per-position acceptance rates learned
online (the first capped by a recent first-token hit rate), or of a drafter's calibrated confidences
for tokens it has drafted. Costs (edgespec.schedule.costs) start from the cost
profile and the drafter's prior and follow the cycles timed.

What the scheduler knows of a (target, drafter) pair is a belief in its acceptance over every
verified position, Beta(α, β): the pair's record (what earlier engines learned, kept on disk) or
PRIOR, worth a few positions, plus every position judged since. A costly drafter's per-position rates
start from its mean in every generation. Long drafts are bet only on a run of right ones
(SLOW_START). When no γ > 0 wins, plain steps run and learning goes on:
- a free drafter (n-gram, history: a whole draft under FREE_DRAFT of a step) drafts in shadow; each
  shadow draft is scored against what the target emits, as verification would have;
- a costly drafter (a draft model, a head) is probed. The speedup g(a) the cost model gives each
  acceptance a, integrated over the belief, gives the gain speculation is expected to add; probes
  may lose PROBE_SHARE × that gain of the plain steps' time. Each verified position narrows the
  belief, so a drafter that cannot win stops being probed, and one that could keeps being tried in
  proportion to what it could win. A pair never judged is tried at once.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from edgespec.drafters.base import Draft, Drafter
from edgespec.errors import EdgespecError
from edgespec.sampling import Dist, SamplingParams
from edgespec.schedule.acceptance import Acceptance, Calibration, Shadows
from edgespec.schedule.costs import K_MAX, CostModel, RobustTime
from edgespec.schedule.rate import Decision, best_gamma, expected_rollback

__all__ = ["K_MAX", "Acceptance", "Calibration", "CostModel", "Decision", "RobustTime", "Scheduler",
           "best_gamma", "expected_rollback"]
PRIOR = 0.5  # a pair never seen: its acceptance estimate starts here ...
STRENGTH = 4.0  # ... worth this many verified positions (and so does each generation's start)
PAIR_WEIGHT = 20.0  # most verified positions the pair's record from earlier engines is worth
PROBE_SHARE = 0.25  # probes may lose this × the speedup a pair is expected to add, of plain-step time
FREE_DRAFT = 0.05  # a drafter whose longest draft costs under this fraction of T(1) drafts in shadow
RECENT = 0.1  # weight of the newest first-token outcome in the recent hit rate
SLOW_START = 4  # γ ≤ max(SLOW_START, 2 × the current run of right drafts)
# a costly drafter drafts at most this many tokens a cycle (a free one: K_MAX − 1). Drafting
# dominates its cycle, so a long draft's tail is a bet at the margin: letting a Q4_1 draft model draft
# up to 31 for SmolLM2 F32 gained greedy (1.49 vs 1.41) but lost at T 0.7 (1.26 vs 1.35) and in the
# ngram,model chain (1.85 vs 2.06), each one run on the same machine
COSTLY_GAMMA = 15
_GRID = (np.arange(256) + 0.5) / 256  # acceptance values the belief is integrated over


@dataclass
class Scheduler:
    """Per cycle: `draft()` plans γ, drafts, and cuts the draft to the best verify length;
    `observe()` learns from the verified cycle; `emitted()` scores shadow drafts."""

    cost: CostModel
    prior: float | None = None  # acceptance this (target, drafter) pair showed before (None: never seen)
    prior_judged: float = 0.0  # the verified positions that record rests on (decayed over generations)
    judged: list[float] = field(default_factory=lambda: [0.0, 0.0])  # verified draft positions: [passed, judged]
    run: int = 0  # the current run of right drafts
    calibration: Calibration = field(default_factory=Calibration)
    acceptance: Acceptance = field(default_factory=Acceptance)  # per-position conditional rates
    shadows: Shadows = field(default_factory=Shadows)
    _support: int | None = None  # the latest draft's match length (n-gram, history; None: not reported)
    _lag: int = 0  # context tokens a costly drafter has not seen yet
    _left: int | None = None  # tokens this generation may still emit (None: unknown)
    _recent: float = PRIOR  # this generation's recent first-token hit rate
    _plain_ms: float = 0.0  # plain-step time since the last probe
    _probing: bool = False
    _drafted: int = 0  # tokens the latest draft computed (a block drafter: all rows asked for)
    _context: int = 0  # tokens in the target's cache at the latest draft() call
    _rollback: list[float] | None = None  # the cost model's T_rollback at the latest draft() call
    _sampled: bool = False  # the latest draft() was for sampled decoding (its confidence is max q)
    _judged_before: tuple[float, float] = (0.0, 0.0)  # `judged` when the current generation began

    def __post_init__(self) -> None:
        self._start()

    def _belief(self) -> tuple[float, float]:
        """The pair's acceptance over every verified position as Beta(α, β): its record (or PRIOR)
        worth a few positions, plus every position judged since."""
        p0, w = (PRIOR, STRENGTH) if self.prior is None else (
            self.prior, min(PAIR_WEIGHT, max(STRENGTH, self.prior_judged)))
        return self.judged[0] + w * p0, self.judged[1] - self.judged[0] + w * (1.0 - p0)

    def long_run(self) -> float:
        """The pair's expected acceptance (the mean of its belief)."""
        a, b = self._belief()
        return a / (a + b)

    def potential(self, acceptance: float | np.ndarray) -> float | np.ndarray:
        """The speedup over plain steps the cost model gives a drafter with this i.i.d. acceptance
        (elementwise for an array)."""
        t_verify = self.cost.t_verify()
        k = np.arange(COSTLY_GAMMA + 1)
        a = np.asarray(acceptance, dtype=float)[..., None]
        tokens = np.cumsum(a ** k, axis=-1)  # 1 + S_1 + ... + S_γ with S_i = a^i
        ms = np.asarray(self.cost.t_draft()[:COSTLY_GAMMA + 1]) + np.asarray(t_verify[1:COSTLY_GAMMA + 2])
        out = (tokens / ms).max(axis=-1) * t_verify[1]
        return float(out) if out.ndim == 0 else out

    def expected_gain(self, baseline_ms: float | None = None) -> tuple[float, float]:
        """E[max(g − 1, 0)] over the belief in the pair's acceptance a, g = potential(a) (over
        `baseline_ms` a token, if given, rather than a plain step's): the speedup speculation is
        expected to add, once found; and E[a | g > 1], the acceptance it has if it wins. A pair that
        could only win were it better than it has shown gets a gain near 0."""
        a, b = self._belief()
        x = _GRID
        logw = (a - 1.0) * np.log(x) + (b - 1.0) * np.log1p(-x)
        w = np.exp(logw - logw.max())
        w /= w.sum()
        g = self.potential(x)
        if baseline_ms is not None:
            g = g * baseline_ms / self.cost.t_verify()[1]
        win = w * (g > 1.0)
        if win.sum() <= 0:
            return 0.0, 0.0
        return float(np.sum(w * np.maximum(g - 1.0, 0.0))), float(np.sum(win * x) / win.sum())

    @property
    def streak(self) -> int:
        """The evidence the next draft is right: the current run of right drafts or, for a copying
        drafter, the length of the match it copies from (known at once after a miss)."""
        return self.run if self._support is None else self._support

    @property
    def free(self) -> bool:
        """Drafting costs next to nothing: a whole draft of K_MAX − 1 tokens (a lookup: one) costs
        under FREE_DRAFT of a plain step. Such a drafter drafts in shadow at plain steps, and verifies
        up to K_MAX − 1 tokens a cycle."""
        prior = self.cost.draft_prior
        longest = K_MAX - 1 if prior.per_token_ms > 0 or prior.fixed_ms > 0 else 1
        return self.cost.t_draft()[longest] < FREE_DRAFT * self.cost.t_verify()[1]

    @property
    def longest(self) -> int:
        """The longest draft this drafter may verify in a cycle."""
        return K_MAX - 1 if self.free else COSTLY_GAMMA

    def plan(self, context: int, limit: int, extra_ms: float = 0.0, baseline_ms: float | None = None
             ) -> tuple[int, float]:
        """The γ ≤ `limit` this drafter would verify after `context` cached tokens, before drafting,
        and its expected rate in tokens per ms (γ 0: a plain step's); `extra_ms` more for any draft (a
        chain member's mean catch-up); `baseline_ms`: the ms per token its drafts must beat to pay for
        reading what it has not (None: a plain step's; a chain's without its costly members)."""
        t_draft, t_verify = self.cost.t_draft(), self.cost.t_verify(context)
        if extra_ms:
            t_draft = [0.0, *(t + extra_ms for t in t_draft[1:])]
        gamma, rate = best_gamma(self._survival(None, 0)[:self._cap(limit)], t_draft, t_verify,
                                 self.cost.t_rollback(context))
        if gamma and not self.free and self._lag > 1 and self._left is not None:
            # a drafter that has yet to read the prompt starts only if the tokens left pay for it
            base = t_verify[1] if baseline_ms is None else min(baseline_ms, t_verify[1])
            if self.cost.t_catch_up(self._lag, context) > self._left * (base - 1.0 / rate):
                gamma = 0
        return gamma, rate if gamma else 1.0 / t_verify[1]

    def draft(self, drafter: Drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator, baseline_ms: float | None = None) -> tuple[Draft, Decision]:
        """Draft for one cycle; at most `limit` (< K_MAX) tokens are kept (`baseline_ms`: as for plan)."""
        t0 = time.perf_counter()
        self._sampled, limit, free = not params.greedy, min(limit, K_MAX - 1), self.free
        self._drafted = 0
        self._context = len(context) - 1  # tokens in the target's cache: all but the pending one
        t_draft, t_verify = self.cost.t_draft(), self.cost.t_verify(self._context)
        self._rollback = self.cost.t_rollback(self._context)
        # a free drafter plans once it has drafted: its streak is the match that draft copies from
        gamma = 0 if free or limit == 0 else self.plan(self._context, limit, baseline_ms=baseline_ms)[0]
        self._probing = gamma == 0 and limit > 0 and not free and (gamma := self._probe(limit, baseline_ms)) > 0
        seconds = time.perf_counter() - t0
        if limit == 0 or (gamma == 0 and not free):
            return Draft([]), Decision(ms=t_verify[1], seconds=seconds)
        rows, block = (limit if free else gamma), self.cost.block  # a free drafter's rest is scored in shadow

        def stop(conf: Sequence[float]) -> bool:  # conf[-1]: the next position, not drawn yet
            return self._cut(conf, len(conf), gamma, t_draft, t_verify, rows if block else len(conf))[0] < len(conf)

        d = drafter.draft(context, rows, params, rng, stop=stop if gamma and not self._probing else None)
        t1 = time.perf_counter()
        self._lag = 0
        if free:
            if d.tokens:
                self.shadows.add(d.tokens[:limit])
                self._support = d.support
            gamma = self.plan(self._context, limit, baseline_ms=baseline_ms)[0]
            if gamma == 0:  # shadow only: a plain step
                return Draft([]), Decision(ms=t_verify[1], seconds=seconds + time.perf_counter() - t1)
        self._drafted = rows if block and d.tokens else len(d.tokens)
        if d.tokens and not self._probing and (params.greedy or d.q is None):
            # a deterministic draft may be cut after the fact; a sampled one may not (its tokens would
            # decide their own verification), so the stop rule above did its cutting
            g, tokens = self._cut(d.confidence, len(d.tokens), min(gamma, len(d.tokens)), t_draft, t_verify,
                                  self._drafted)
        else:
            g = len(d.tokens)
            tokens = 1.0 + sum(self._survival(d.confidence, g)[:g])
        d = d.head(g)
        ms = t_draft[self._drafted] + t_verify[g + 1] + expected_rollback(
            self._survival(d.confidence, g), g, self._rollback)
        return d, Decision(g, tokens, ms, self._probing, seconds + time.perf_counter() - t1,
                           draft_ms=t_draft[self._drafted])

    def observe(self, draft: Draft, accepted: int, t_draft: float, t_verify: float,
                context: int | None = None, rollback: float = 0.0) -> None:
        """Learn from a verified cycle (times in seconds) that began with `context` tokens in the
        target's cache (None: as the latest `draft()` saw); `rollback`: a recurrent target's time to
        come back to the accepted tokens (0: none)."""
        g = len(draft.tokens)
        context = self._context if context is None else context
        self.cost.observe_verify(g + 1, t_verify * 1000, context)
        if rollback:
            self.cost.observe_rollback(accepted, rollback * 1000, context)
        if not self._drafted:
            self._plain_ms += t_verify * 1000
            return
        # what was drafted is paid for (a block: every row), however much of it was verified
        self.cost.observe_draft(max(g, self._drafted), t_draft * 1000, draft.synced, draft.copied)
        if not self.free:  # a free drafter's drafts are all scored in shadow, verified part included
            self.acceptance.observe(g, accepted)  # g 0: cut to nothing by its confidences, a draft that
            self.judged[0] += accepted  # did not pay: its first token counts as missed in the recent rate
            self.judged[1] += min(accepted + 1, g)
            self.run = self.run + g if g and accepted == g else 0
            self._recent += RECENT * ((accepted > 0) - self._recent)
        if draft.confidence is not None:
            self.calibration.observe(draft.confidence, accepted)
        self._plain_ms = 0.0

    def emitted(self, tokens: Sequence[int], probs: Sequence[Dist | np.ndarray] | None = None) -> None:
        """Score the shadow drafts against tokens the target emitted (Shadows.score: greedy, a token is
        right when it is the emitted one; sampled, with `probs`, it is credited p(x̃), the chance
        verification accepts it)."""
        self._lag += len(tokens)
        if self._left is not None:
            self._left = max(0, self._left - len(tokens))
        for j, tok in enumerate(tokens):
            hit = self.shadows.score(tok, None if probs is None else probs[j], self._shadow_seen)
            if hit is not None:
                self.run = self.run + 1 if hit else 0

    def new_generation(self, n_prompt: int, max_tokens: int | None = None) -> None:
        """A new prompt of n_prompt tokens and a reply of at most max_tokens: drop pending shadow
        drafts; a costly drafter starts again from the pair's estimate (one bad stretch must not
        switch it off) and has yet to read the prompt."""
        self.shadows, self.run, self._lag, self._left = Shadows(), 0, n_prompt, max_tokens
        self._judged_before = (self.judged[0], self.judged[1])
        if not self.free:
            self._start()

    def generation_judged(self) -> tuple[float, float]:
        """Verified draft positions since `new_generation`: (passed, judged), the pair's record."""
        return self.judged[0] - self._judged_before[0], self.judged[1] - self._judged_before[1]

    # -- internals --------------------------------------------------------------------------------

    def _start(self) -> None:
        """The per-position rates and the recent hit rate start from the pair's estimate."""
        self._recent = p0 = self.long_run()
        self.acceptance = Acceptance(p0, strength=STRENGTH)

    def _shadow_seen(self, i: int, credit: float) -> None:
        self.acceptance.observe_position(i, credit)
        if i == 0:
            self._recent += RECENT * (credit - self._recent)

    def _cap(self, limit: int) -> int:
        """Slow start: long drafts are bet only on a run of right ones."""
        return min(limit, self.longest, max(SLOW_START, 2 * self.streak))

    def _survival(self, confidence: Sequence[float] | None, n: int) -> list[float]:
        """S_i for i = 1..K_MAX − 1: calibrated confidence for the first n drafted tokens when the
        drafter gives it, the learned rates after (the first capped by the recent hit rate)."""
        a = list(self.acceptance.rates)
        a[0] = min(a[0], self._recent)
        if confidence is not None:  # sampled: a bin not yet seen starts from the position's rate
            a[:n] = [self.calibration(c, a[i] if self._sampled else None) for i, c in enumerate(confidence[:n])]
        return list(accumulate(a, operator.mul))

    def _cut(self, confidence: Sequence[float] | None, n: int, most: int, t_draft: Sequence[float],
             t_verify: Sequence[float], sunk: int) -> tuple[int, float]:
        """Best γ ≤ `most` once n confidences are known and `sunk` tokens drafted: (γ, E[tokens])."""
        s = self._survival(confidence, n)[:most]
        g, _ = best_gamma(s, [t_draft[max(g, sunk)] for g in range(most + 1)], t_verify, self._rollback)
        return g, 1.0 + sum(s[:g])

    def _probe(self, limit: int, baseline_ms: float | None = None) -> int:
        """A probe's γ, if its turn has come: the γ that wins at the acceptance the pair has if it
        wins, once the plain steps since the last probe have run long enough that its expected loss
        fits PROBE_SHARE × the speedup the pair is expected to add (`expected_gain`; 0: no probes). A
        pair never judged is tried at once, if that gain over the reply left repays its catch-up
        (`baseline_ms`: the ms per token it must beat, as for plan)."""
        t_draft, t_verify = self.cost.t_draft(), self.cost.t_verify(self._context)
        fresh = self.prior is None and not self.judged[1]
        base = min(baseline_ms, t_verify[1]) if fresh and baseline_ms is not None else None
        gain, hope = self.expected_gain(base)
        if gain <= 0:
            return 0
        g = max(1, best_gamma([hope ** i for i in range(1, self._cap(limit) + 1)], t_draft, t_verify,
                              self._rollback)[0])
        catch_up = self.cost.t_catch_up(self._lag, self._context)
        if fresh:
            left = float("inf") if self._left is None else self._left
            return g if catch_up <= gain * left * (t_verify[1] if base is None else base) else 0
        s = self._survival(None, 0)
        loss = (t_draft[g] + t_verify[g + 1] + expected_rollback(s, g, self._rollback)
                - (1.0 + sum(s[:g])) * t_verify[1] + catch_up)
        return g if self._plain_ms * PROBE_SHARE * gain >= loss else 0


def check_num_draft(value: int | str) -> int | str:
    """γ ≥ 0, or "auto"."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        gamma = int(value)
    except (TypeError, ValueError):
        raise EdgespecError(f"num_draft must be an integer >= 0 or 'auto' (got {value!r})") from None
    if gamma < 0:
        raise EdgespecError(f"num_draft must be >= 0 or 'auto' (got {gamma})")
    return gamma
