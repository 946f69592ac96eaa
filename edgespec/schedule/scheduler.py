"""The batch-1 scheduler (`-k auto`): how many tokens to draft and verify, cycle by cycle.

Each cycle takes the γ (0 = a plain step) with the most expected tokens per second,

    rate(γ) = E[tokens | γ] / (T_draft(γ) + T_verify(γ + 1) + Σ_{n<γ} (S_n − S_{n+1})·T_rollback(n)),

with E[tokens | γ] = 1 + S₁ + … + S_γ, where S_i (S₀ = 1), the chance that drafts 1..i are all
accepted, is the product of per-position conditional
acceptance rates learned online, or of the drafter's calibrated confidences for tokens already
drafted (DSpark's survival product). Costs (edgespec.schedule.costs) start from the cost profile and the
drafter's prior, follow the cycles actually timed and grow with the context (attention is not
shared by a batch); T_draft(γ) = fixed + γ·per_token, and a block
drafter (DFlash: one forward for every row) has paid for all rows before its confidences are known,
so its confidence cut shortens verification only. T_rollback is 0 for a KV cache; a recurrent
target re-evaluates the kept tokens after a partial acceptance (edgespec.schedule.costs). When no γ > 0 wins,
plain steps run and learning goes on: a free drafter (n-gram)
drafts in shadow and is scored against what the target emits next; a costly one is probed on a
small time budget.

A costly drafter the cost model says could win big (≥ EXPLORE_GAIN × plain at EXPLORE_ACCEPTANCE:
a same-family draft model on a bandwidth-bound target) is not left to probes: it starts from what
earlier generations of the same (target, drafter) pair learned (`prior`, kept on disk by the
engine), or, never seen, from an optimistic prior worth a few verified positions, so it drafts from
the first cycle and a bad one is switched off after two or three misses. Where even a good drafter
cannot win (a compute-bound target), nothing changes: plain steps and rare probes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edgespec.drafters.base import Draft, Drafter
from edgespec.errors import EdgespecError
from edgespec.sampling import Dist, SamplingParams
from edgespec.schedule.acceptance import Acceptance, Calibration
from edgespec.schedule.costs import K_MAX, CostModel, RobustTime
from edgespec.schedule.rate import Decision, best_gamma, expected_rollback

__all__ = ["K_MAX", "Acceptance", "Calibration", "CostModel", "Decision", "RobustTime", "Scheduler",
           "best_gamma", "expected_rollback"]
FREE_DRAFT = 0.05  # a drafter whose longest draft costs under this fraction of T(1) drafts in shadow
PROBE_BUDGET = 0.01  # share of plain-step time a costly drafter may lose on probes (halved per failed one)
PROBE_ACCEPTANCE = 0.9  # a probe drafts what would win at this acceptance
PROBE_SHARE = 0.25  # a drafter that could win g× may lose this × (g − 1) of plain-step time on probes
PROBE_OPTIMISM = 2.0  # ... g at its long-run acceptance plus this many standard deviations of it
MAX_SHADOWS = 16  # shadow drafts being scored at once
RECENT = 0.3  # weight of the newest first-token outcome in the recent hit rate
SLOW_START = 4  # γ ≤ max(SLOW_START, 2 × the current run of right drafts)
RUN_PRIORS = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)  # prior acceptance after a run of 0, 1, 2-3, 4-7, 8-15, 16+ hits
EXPLORE_ACCEPTANCE = 0.95  # what a same-family draft model reaches (greedy): the optimistic prior
EXPLORE_GAIN = 1.02  # a costly drafter that would beat plain steps at EXPLORE_ACCEPTANCE (by this much) is tried at once
EXPLORE_STRENGTH = 3.0  # weight, in verified positions, of the prior it starts from
PAIR_WEIGHT = 20.0  # most verified positions the pair's record from earlier engines is worth against this one's
# a costly drafter (a draft model, a head) drafts at most this many tokens a cycle, and its potential
# is judged on such drafts; only a free one's copies are verified up to K_MAX − 1 at once. Drafting
# dominates a costly drafter's cycle, so a long draft's tail is a bet at the margin: letting a Q4_1
# draft model draft up to 31 for SmolLM2 F32 gained greedy (1.49 vs 1.41) but lost at T 0.7
# (1.26 vs 1.35) and in the ngram,model chain (1.85 vs 2.06), each one run on the same machine
COSTLY_GAMMA = 15


@dataclass
class Scheduler:
    """Per cycle: `draft()` plans γ, drafts, and cuts the draft to the best verify length;
    `observe()` learns from the verified cycle; `emitted()` scores a shadow draft."""

    cost: CostModel
    prior: float | None = None  # acceptance this (target, drafter) pair showed before (None: never seen)
    prior_judged: float = 0.0  # the verified positions that record rests on (decayed over generations)
    # acceptance by the current run of drafted tokens that were right (0, 1, 2-3, 4-7, 8-15, 16+):
    # drafts come in runs (a quote being copied, then new text), and the run so far is the best
    # single predictor of the next token; each run bucket learns its own per-position rates
    by_run: list[Acceptance] = field(default_factory=lambda: [Acceptance(p) for p in RUN_PRIORS])
    run: int = 0
    calibration: Calibration = field(default_factory=Calibration)
    _support: int | None = None  # the latest draft's match length (n-gram, history; None: not reported)
    _lag: int = 0  # context tokens a costly drafter has not seen yet
    _left: int | None = None  # tokens this generation may still emit (None: unknown)
    _recent: float = 0.5  # this generation's recent first-token hit rate (fast EMA)
    _shadows: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (draft, [n matched])
    _plain_ms: float = 0.0  # plain-step time since the last probe
    _backoff: float = 1.0  # each failed probe doubles the wait for the next
    _probing: bool = False
    _drafted: int = 0  # tokens the latest draft computed (a block drafter: all rows asked for)
    _context: int | None = None  # tokens in the target's cache at the latest draft() call
    _rollback: list[float] | None = None  # the cost model's T_rollback at the latest draft() call
    _start: float = 0.5  # the recent first-token hit rate a generation starts from
    _sampled: bool = False  # the latest draft() was for sampled decoding (its confidence is max q)
    judged: list[float] = field(default_factory=lambda: [0.0, 0.0])  # verified draft positions: [passed, judged]
    _judged_before: tuple[float, float] = (0.0, 0.0)  # `judged` when the current generation began

    def __post_init__(self) -> None:
        self._explore = not self.free and self.potential(EXPLORE_ACCEPTANCE) >= EXPLORE_GAIN
        if self._explore:
            self._start_from(self.long_run())

    def long_run(self, optimism: float = 0.0) -> float:
        """The pair's acceptance over every verified position so far, with the prior worth a few
        positions (the pair's record: as many as it rests on, up to PAIR_WEIGHT); `optimism`:
        standard deviations of that estimate added (what the pair may yet turn out to be while
        few positions are known)."""
        if self.prior is None:
            p0, w = EXPLORE_ACCEPTANCE, EXPLORE_STRENGTH
        else:
            p0, w = self.prior, min(PAIR_WEIGHT, max(EXPLORE_STRENGTH, self.prior_judged))
        n = self.judged[1] + w
        mean = (self.judged[0] + w * p0) / n
        return min(1.0, mean + optimism * (mean * (1.0 - mean) / (n + 1.0)) ** 0.5)

    def _start_from(self, p0: float) -> None:
        """Every run bucket and the recent hit rate start from acceptance p0, worth a few positions."""
        self.by_run = [Acceptance(p0, strength=EXPLORE_STRENGTH) for _ in RUN_PRIORS]
        self._recent = self._start = p0

    def potential(self, acceptance: float) -> float:
        """The speedup over plain steps the cost model gives a drafter with this i.i.d. acceptance."""
        t_verify = self.cost.t_verify()
        _, rate = best_gamma([acceptance ** i for i in range(1, COSTLY_GAMMA + 1)], self.cost.t_draft(), t_verify)
        return rate * t_verify[1]

    @property
    def streak(self) -> int:
        """The evidence the next draft is right: the current run of right drafts or, for a drafter that
        copies (n-gram, history), the length of the match it copies from: context tokens that agree
        with the copy's source are the same evidence as a run of right drafts, and known at once after
        a miss (a long match after a miss is the rest of a copy; a run over a match this short is not)."""
        return self.run if self._support is None else self._support

    @property
    def acceptance(self) -> Acceptance:
        """The acceptance model for the current streak."""
        return self.by_run[min(self.streak.bit_length(), len(self.by_run) - 1)]

    @property
    def free(self) -> bool:
        """Drafting costs next to nothing (n-gram): no probes, plain steps draft in shadow, K_MAX − 1
        tokens a cycle, so a priced drafter (model, head) is free only if that whole draft is (a head
        at 1 ms a token beside a 22 ms step is not). A lookup is judged per token, as timed."""
        prior = self.cost.draft_prior
        longest = K_MAX - 1 if prior.per_token_ms > 0 or prior.fixed_ms > 0 else 1
        return self.cost.t_draft()[longest] < FREE_DRAFT * self.cost.t_verify()[1]

    @property
    def longest(self) -> int:
        """The longest draft this drafter may verify in a cycle (COSTLY_GAMMA unless it is free)."""
        return K_MAX - 1 if self.free else COSTLY_GAMMA

    def plan(self, context: int, limit: int, extra_ms: float = 0.0, baseline_ms: float | None = None
             ) -> tuple[int, float]:
        """The γ ≤ `limit` this drafter would verify after `context` cached tokens, before drafting
        (confidences not known yet), and its expected rate in tokens per ms (γ 0: a plain step's);
        `extra_ms` more for any draft (a chain member's mean catch-up on tokens others drafted);
        `baseline_ms`: the ms per token its drafts must save against to pay for reading what it has not
        (None: a plain step's; a chain's, without its costly members)."""
        t_draft, t_verify = self.cost.t_draft(), self.cost.t_verify(context)
        limit = min(limit, self.longest)
        if extra_ms:
            t_draft = [0.0, *(t + extra_ms for t in t_draft[1:])]
        # slow start: bet long drafts only on a run of right ones (a stale estimate costs less)
        gamma, rate = best_gamma(self._survival(None, 0)[:min(limit, K_MAX - 1, max(SLOW_START, 2 * self.streak))],
                                 t_draft, t_verify, self.cost.t_rollback(context))
        if gamma and not self.free and self._lag > 1 and self._left is not None and rate > 0:
            # a drafter that has yet to read the prompt starts only if what the tokens left would
            # save pays for that reading (a long prompt, a short reply: plain steps)
            base = t_verify[1] if baseline_ms is None else min(baseline_ms, t_verify[1])
            if self.cost.t_catch_up(self._lag, context) > self._left * (base - 1.0 / rate):
                gamma = 0
        return gamma, rate if gamma else 1.0 / t_verify[1]

    def draft(self, drafter: Drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator, baseline_ms: float | None = None) -> tuple[Draft, Decision]:
        """Draft for one cycle; at most `limit` (< K_MAX) tokens are kept (`baseline_ms`: as for plan)."""
        t0 = time.perf_counter()
        self._sampled = not params.greedy
        limit = min(limit, K_MAX - 1)
        self._context = len(context) - 1  # tokens in the target's cache: all but the pending one
        t_draft, t_verify = self.cost.t_draft(), self.cost.t_verify(self._context)
        self._rollback = self.cost.t_rollback(self._context)
        free = self.free
        # a free drafter plans once it has drafted: its streak is the match that draft copies from
        gamma = 0 if free else self.plan(self._context, limit, baseline_ms=baseline_ms)[0]
        probe = False
        if gamma == 0 and limit > 0 and not free:
            gamma = self._probe_gamma(limit, t_draft, t_verify)
            probe = gamma > 0
        self._probing = probe
        seconds = time.perf_counter() - t0
        if limit == 0 or (gamma == 0 and not free):
            return Draft([]), Decision(ms=t_verify[1], seconds=seconds)

        # a free drafter drafts to the limit: what is not verified is scored in shadow
        rows = limit if free else gamma
        block = self.cost.block  # every row is computed before any confidence: a cut saves verification only

        def stop(conf: Sequence[float]) -> bool:  # conf[-1]: the next position, not drawn yet
            sunk = rows if block else len(conf)
            return self._cut(conf, len(conf), gamma, t_draft, t_verify, sunk)[0] < len(conf)

        d = drafter.draft(context, rows, params, rng, stop=stop if gamma and not probe else None)
        t1 = time.perf_counter()
        self._lag = 0
        self._drafted = rows if block and d.tokens else len(d.tokens)
        if free:
            if d.tokens:  # every draft is scored against what the target emits, verified or not
                self._shadows = [*self._shadows[-(MAX_SHADOWS - 1):], (d.tokens[:limit], [0])]
                self._support = d.support
            gamma = self.plan(self._context, limit, baseline_ms=baseline_ms)[0]
            if gamma == 0:  # shadow only: a plain step
                return Draft([]), Decision(ms=t_verify[1], seconds=seconds + time.perf_counter() - t1)
        if d.tokens and not probe and (params.greedy or d.q is None):
            # a deterministic draft may be cut after the fact; a sampled one may not (its tokens
            # would decide their own verification), so the stop rule above did its cutting
            g, tokens = self._cut(d.confidence, len(d.tokens), min(gamma, len(d.tokens)), t_draft, t_verify,
                                  self._drafted)
        else:
            g = len(d.tokens)
            tokens = 1.0 + sum(self._survival(d.confidence, g)[:g])
        d = d.head(g)
        seconds += time.perf_counter() - t1
        ms = t_draft[self._drafted] + t_verify[g + 1] + expected_rollback(
            self._survival(d.confidence, g), g, self._rollback)
        return d, Decision(g, tokens, ms, probe, seconds, draft_ms=t_draft[self._drafted])

    def observe(self, draft: Draft, accepted: int, t_draft: float, t_verify: float,
                context: int | None = None, rollback: float = 0.0) -> None:
        """Learn from a verified cycle (times in seconds) that began with `context` tokens in the
        target's cache (None: as the latest `draft()` call saw); `rollback`: the time a recurrent
        target took to come back to the accepted tokens (0: none, or not recurrent)."""
        g = len(draft.tokens)
        free = self.free
        context = self._context if context is None else context
        self.cost.observe_verify(g + 1, t_verify * 1000, context)
        if rollback:
            self.cost.observe_rollback(accepted, rollback * 1000, context)
        if g:  # the cost of what was drafted (a block: every row computed), however much was verified
            self.cost.observe_draft(max(g, self._drafted), t_draft * 1000, draft.synced, draft.copied)
            if not free:  # a free drafter's drafts are all scored in shadow, verified part included
                self.acceptance.observe(g, accepted)
                self.judged[0] += accepted
                self.judged[1] += min(accepted + 1, g)
                self.run = self.run + g if accepted == g else 0
                self._recent += RECENT * ((accepted > 0) - self._recent)
            if draft.confidence is not None:
                self.calibration.observe(draft.confidence, accepted)
            if self._probing:
                self._backoff = 1.0 if accepted == g else min(64.0, 2 * self._backoff)
            self._plain_ms = 0.0
        else:
            self._plain_ms += t_verify * 1000

    def emitted(self, tokens: Sequence[int], probs: Sequence[Dist | np.ndarray] | None = None) -> None:
        """Score the pending shadow drafts against tokens the target emitted. Greedy: a draft token
        is right when it is the emitted one, exactly what verification would have accepted. Sampled:
        `probs` (the target's processed row for each emitted token, when given: `probs[j][x]` is p(x)) credits a draft token
        with p(x̃), the chance verification accepts it, rather than with the 0/1 of whether the draw
        happened to equal it: the same mean, far less noise, so a few lucky draws do not start bets.
        The shadow follows the emitted text either way. One is drafted at every plain step, so the
        estimates follow the text as fast as it changes."""
        self._lag += len(tokens)
        if self._left is not None:
            self._left = max(0, self._left - len(tokens))
        for j, tok in enumerate(tokens):
            live, model, hit = [], self.acceptance, None
            for draft, seen in self._shadows:  # oldest first: the newest draft sets the run
                i = seen[0]
                hit = tok == draft[i]
                credit = float(probs[j][draft[i]]) if probs is not None else float(hit)
                model.observe_position(i, credit)
                if i == 0:
                    self._recent += RECENT * (credit - self._recent)
                if hit and i + 1 < len(draft):
                    seen[0] += 1
                    live.append((draft, seen))
            self._shadows = live
            if hit is not None:
                self.run = self.run + 1 if hit else 0

    def new_generation(self, n_prompt: int, max_tokens: int | None = None) -> None:
        """A new prompt of n_prompt tokens and a reply of at most max_tokens: drop pending shadow
        drafts, start from the cautious state; a costly drafter has yet to read the prompt (drafting
        pays for that)."""
        self._shadows, self.run, self._lag, self._recent = [], 0, n_prompt, self._start
        self._left = max_tokens
        self._judged_before = (self.judged[0], self.judged[1])
        if self._explore:  # each text starts from the pair's long-run acceptance, not from how the
            self._start_from(self.long_run())  # last one ended: one bad stretch must not switch it off

    def generation_judged(self) -> tuple[float, float]:
        """Verified draft positions since `new_generation`: (passed, judged), the pair's record."""
        return self.judged[0] - self._judged_before[0], self.judged[1] - self._judged_before[1]

    # -- internals --------------------------------------------------------------------------------

    def _survival(self, confidence: Sequence[float] | None, n: int) -> list[float]:
        """S_i for i = 1..K from conditional acceptance: calibrated confidence for the first n
        drafted tokens when the drafter gives it, the learned per-position rates after (the first
        capped by the recent first-token hit rate)."""
        a = list(self.acceptance.rates)
        a[0] = min(a[0], self._recent)  # the run's model must agree with how this text is going
        if confidence is not None:  # a sampled draft passes with Σ min(p, q), high for a close drafter
            # however flat q is: there a bin not yet seen starts from the position's rate, not from c
            a[:n] = [self.calibration(c, a[i] if self._sampled else None) for i, c in enumerate(confidence[:n])]
        out, s = [], 1.0
        for x in a:
            s *= x
            out.append(s)
        return out

    def _cut(self, confidence: Sequence[float] | None, n: int, most: int, t_draft: Sequence[float],
             t_verify: Sequence[float], sunk: int) -> tuple[int, float]:
        """Best γ ≤ `most` once n confidences are known and `sunk` tokens drafted (their cost is
        spent whatever γ verifies): returns (γ, expected tokens)."""
        s = self._survival(confidence, n)[:most]
        g, _ = best_gamma(s, [t_draft[max(g, sunk)] for g in range(most + 1)], t_verify, self._rollback)
        return g, 1.0 + sum(s[:g])

    def _probe_gamma(self, limit: int, t_draft: Sequence[float], t_verify: Sequence[float]) -> int:
        """A probe's γ if its turn has come: what would win at PROBE_ACCEPTANCE, once plain steps
        have run long enough that the probe's expected loss fits PROBE_BUDGET of their time (a drafter
        that could win g× at the pair's long-run acceptance: PROBE_SHARE·(g − 1), when larger). A
        probe bets like a slow start: no longer than a draft after the current run may be; a drafter
        explored for its promise drafts what would win at the acceptance it may yet show, if higher
        (a pair that wins only when right ~98% of the time has no γ that wins at 0.9)."""
        limit = min(limit, self.longest, max(SLOW_START, 2 * self.streak))
        hope = self.long_run(PROBE_OPTIMISM) if self._explore else 0.0
        a = max(PROBE_ACCEPTANCE, hope)
        g_opt, _ = best_gamma([a ** i for i in range(1, limit + 1)], t_draft, t_verify, self._rollback)
        g = max(g_opt, 1)
        survival = self._survival(None, 0)
        loss = (t_draft[g] + t_verify[g + 1] + expected_rollback(survival, g, self._rollback)
                - (1.0 + sum(survival[:g])) * t_verify[1] + self.cost.t_catch_up(self._lag, self._context))
        budget = PROBE_BUDGET
        if self._explore:  # what the drafter may yet be shown to win sizes what probes may lose
            budget = max(budget, PROBE_SHARE * (self.potential(hope) - 1.0))
        budget = budget if g_opt > 0 else budget / 10
        return g if self._plain_ms * budget >= loss * self._backoff else 0


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
