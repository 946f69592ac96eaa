"""The batch-1 scheduler (`-k auto`): how many tokens to draft and verify, cycle by cycle.

Each cycle takes the γ (0: a plain step) with the most expected tokens per ms (edgespec.schedule.rate),

    rate(γ) = (1 + S₁ + … + S_γ) / (T_draft(γ) + T_verify(γ + 1) + E[rollback | γ]),

S_i being the chance that drafts 1..i all pass: a product of per-position acceptance rates learned
online (the first capped by a recent first-token hit rate), or of a drafter's calibrated confidences
for tokens it has drafted. Costs (edgespec.schedule.costs) start from the cost
profile and the drafter's prior and follow the cycles timed.

What the scheduler knows of a (target, drafter) pair (edgespec.schedule.acceptance.Learned) is a
belief in its acceptance over every verified position, Beta(α, β): the pair's record (what earlier
engines learned, kept on disk) or PRIOR, worth a few positions, plus every position judged since. A
costly drafter's per-position rates start from its mean in every generation. Long drafts are bet
only on a run of right ones or, for a copying drafter, a long match (SLOW_START). When no γ > 0
wins, plain steps run and learning goes on:
- a free drafter (a lookup that does not price itself: n-gram, history) drafts in shadow; each
  shadow draft is scored against what the target emits, as verification would have;
- a costly drafter (a draft model, a head) is probed. The speedup g(a) the cost model gives each
  acceptance a, integrated over the belief, gives the gain speculation is expected to add; probes
  may lose, in all, PROBE_SHARE × that gain of the plain steps' time. Each probe spends that time by
  what it lost against plain steps (one that won: nothing, so a pair whose probes keep winning keeps
  being tried); drafting on the plan's own merits spends all of it. Each verified position narrows
  the belief, so a drafter that cannot win stops being probed, and one that could keeps being tried
  in proportion to what it could win. A pair never judged is tried at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field

import numpy as np

from edgespec.drafters.base import Draft, Drafter
from edgespec.errors import EdgespecError
from edgespec.sampling import Dist, SamplingParams
from edgespec.schedule.acceptance import Acceptance, Calibration, Learned, SiblingRates
from edgespec.schedule.costs import K_MAX, CostModel, RobustTime
from edgespec.schedule.rate import Decision, best_gamma, cut, expected_rollback

__all__ = ["K_MAX", "Acceptance", "Calibration", "CostModel", "Decision", "Learned", "RobustTime", "Scheduler",
           "best_gamma", "expected_rollback"]
PROBE_SHARE = 0.25  # probes may lose this × the speedup a pair is expected to add, of plain-step time
SLOW_START = 4  # γ ≤ max(SLOW_START, 2 × the run of right drafts, or of a copying drafter's match)
# a costly drafter drafts at most this many tokens a cycle (a free one: K_MAX − 1): drafting
# dominates its cycle, so a long draft's tail is a bet at the margin (docs/scheduler.md: on the
# replay, 31 and 8 each lose cells, −0.23% and −0.35% in the geometric mean)
COSTLY_GAMMA = 15


@dataclass
class Scheduler:
    """Per cycle: `draft()` plans γ, drafts, and cuts the draft to the best verify length;
    `observe()` learns from the verified cycle; `emitted()` scores shadow drafts. What it knows of
    the pair's acceptance is `learned` (from the pair's record `prior`, if any)."""

    cost: CostModel
    prior: InitVar[float | None] = None  # acceptance this (target, drafter) pair showed before (None: never seen)
    learned: Learned = field(init=False)
    tree_calibration: Calibration = field(init=False)  # of tree nodes beside the chain (schedule.trees)
    tree_siblings: SiblingRates = field(init=False)  # of sampled side trees' siblings (schedule.trees)
    _support: int | None = None  # the latest draft's match length (n-gram, history; None: not reported)
    _lag: int = 0  # context tokens a costly drafter has not seen yet
    _left: int | None = None  # tokens this generation may still emit (None: unknown)
    _plain_ms: float = 0.0  # plain-step time, less what probes lost ÷ (PROBE_SHARE × gain) (_probe)
    _probing: bool = False
    _drafted: int = 0  # tokens the latest draft computed (a block drafter: all rows asked for)
    _context: int = 0  # tokens in the target's cache at the latest draft() call
    _rollback: list[float] | None = None  # the cost model's T_rollback at the latest draft() call
    _sampled: bool = False  # the latest draft() was for sampled decoding (its confidence is max q)

    def __post_init__(self, prior: float | None) -> None:
        self.learned, self.tree_calibration, self.tree_siblings = Learned(prior), Calibration(), SiblingRates()

    def expected_gain(self, baseline_ms: float | None = None) -> tuple[float, float]:
        """Learned.expected_gain of the cost model's speedup (over `baseline_ms` a token, if given)."""
        scale = 1.0 if baseline_ms is None else baseline_ms / self.cost.t_verify()[1]
        return self.learned.expected_gain(lambda a, sums: self.cost.speedup(a, COSTLY_GAMMA, sums) * scale)

    def plan(self, context: int, limit: int, extra_ms: float = 0.0, baseline_ms: float | None = None
             ) -> tuple[int, float]:
        """The γ ≤ `limit` to verify after `context` cached tokens, before drafting, and its rate in
        tokens per ms (γ 0: a plain step's); `extra_ms` more per draft (a chain member's catch-up);
        `baseline_ms`: the ms per token a drafter that has yet to read the context must beat (None: a
        plain step's; a chain's without its costly members)."""
        t_draft, t_verify = self.cost.t_draft(), self.cost.t_verify(context)
        if extra_ms:
            t_draft = [0.0, *(t + extra_ms for t in t_draft[1:])]
        gamma, rate = best_gamma(self.survival(None, 0)[:self.longest(limit)], t_draft, t_verify,
                                 self.cost.t_rollback(context))
        if gamma and not self.cost.free and self._lag > 1 and self._left is not None:
            # a drafter that has yet to read the prompt starts only if the tokens left pay for it
            base = t_verify[1] if baseline_ms is None else min(baseline_ms, t_verify[1])
            if self.cost.t_catch_up(self._lag, context) > self._left * (base - 1.0 / rate):
                gamma = 0
        return gamma, rate if gamma else 1.0 / t_verify[1]

    def draft(self, drafter: Drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator, baseline_ms: float | None = None) -> tuple[Draft, Decision]:
        """Draft for one cycle; at most `limit` (< K_MAX) tokens are kept (`baseline_ms`: as for plan)."""
        t0 = time.perf_counter()
        self._sampled, limit, free = not params.greedy, min(limit, K_MAX - 1), self.cost.free
        self._drafted, self._context = 0, len(context) - 1  # in the target's cache: all but the pending token
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
            s = self.survival(conf, len(conf))[:gamma]
            return cut(s, t_draft, t_verify, rows if block else len(conf), self._rollback)[0] < len(conf)

        d = drafter.draft(context, rows, params, rng, stop=stop if gamma and not self._probing else None)
        t1 = time.perf_counter()
        self._lag = 0
        if free:
            if d.tokens:
                self.learned.shadows.add(d.tokens[:limit])
                self._support = d.support
            gamma = self.plan(self._context, limit, baseline_ms=baseline_ms)[0]
            if gamma == 0:  # shadow only: a plain step
                return Draft([]), Decision(ms=t_verify[1], seconds=seconds + time.perf_counter() - t1)
        self._drafted = rows if block and d.tokens else len(d.tokens)
        if d.tokens and not self._probing and (params.greedy or d.q is None):
            # a deterministic draft may be cut after the fact; a sampled one may not (its tokens would
            # decide their own verification), so the stop rule above did its cutting
            s = self.survival(d.confidence, len(d.tokens))[:min(gamma, len(d.tokens))]
            g, tokens = cut(s, t_draft, t_verify, self._drafted, self._rollback)
        else:
            g = len(d.tokens)
            tokens = 1.0 + sum(self.survival(d.confidence, g)[:g])
        d = d.head(g)
        ms = t_draft[self._drafted] + t_verify[g + 1] + expected_rollback(
            self.survival(d.confidence, g), g, self._rollback)
        return d, Decision(g, tokens, ms, self._probing, seconds + time.perf_counter() - t1,
                           draft_ms=t_draft[self._drafted])

    def observe(self, draft: Draft, accepted: int, t_draft: float, t_verify: float,
                context: int | None = None, rollback: float = 0.0, verified: int | None = None) -> None:
        """Learn from a verified cycle (times in s) begun with `context` tokens cached (None: as the
        latest `draft()` saw); `rollback`: a recurrent target's time to restore the accepted ones;
        `verified`: the tokens the verification evaluated (None: the draft's and the pending one)."""
        g = len(draft.tokens)
        context = self._context if context is None else context
        self.cost.observe_verify(g + 1 if verified is None else verified, t_verify * 1000, context)
        if rollback:
            self.cost.observe_rollback(accepted, rollback * 1000, context)
        if not self._drafted:
            self._plain_ms += t_verify * 1000
            return
        # what was drafted is paid for (a block: every row), however much of it was verified
        self.cost.observe_draft(max(g, self._drafted), t_draft * 1000, draft.synced, draft.copied)
        if self._probing and (share := PROBE_SHARE * self.expected_gain()[0]) > 0:
            # a probe spends plain-step time by what it lost against plain steps (one that won: none)
            lost = (t_draft + t_verify) * 1000 - (accepted + 1) * self.cost.t_verify(context)[1]
            self._plain_ms = max(0.0, self._plain_ms - max(0.0, lost) / share)
        else:
            self._plain_ms = 0.0
        # a free drafter's drafts are all scored in shadow, verified part included
        self.learned.observe(g, accepted, draft.confidence, scored=not self.cost.free)

    def emitted(self, tokens: Sequence[int], probs: Sequence[Dist] | None = None) -> None:
        """Tokens the target emitted (`probs`: its rows, sampled): shadow drafts are scored on them."""
        self._lag += len(tokens)
        if self._left is not None:
            self._left = max(0, self._left - len(tokens))
        self.learned.emitted(tokens, probs)

    def new_generation(self, n_prompt: int, max_tokens: int | None = None) -> None:
        """A new prompt of n_prompt tokens (unread by a costly drafter), a reply of ≤ max_tokens."""
        self._lag, self._left = n_prompt, max_tokens
        self.learned.new_generation(costly=not self.cost.free)

    def longest(self, limit: int) -> int:
        """The longest draft worth verifying now (slow start: long drafts are bet only on a run of
        right ones or, for a copying drafter, on the match it copies from, known at once after a miss)."""
        streak = self.learned.run if self._support is None else self._support
        return min(limit, K_MAX - 1 if self.cost.free else COSTLY_GAMMA, max(SLOW_START, 2 * streak))

    def survival(self, confidence: Sequence[float] | None, n: int) -> list[float]:
        """S_1..S_{K_MAX−1} for a draft of n tokens with these confidences (as the latest draft() prices)."""
        return self.learned.survival(confidence, n, self._sampled)

    def _probe(self, limit: int, baseline_ms: float | None = None) -> int:
        """A probe's γ (0: none yet; the module docstring says when): the γ that wins at the acceptance
        the pair has if it wins. A pair never judged is tried at once, if its expected gain over the
        reply left repays its catch-up (`baseline_ms`: the ms per token it must beat, as for plan)."""
        t_draft, t_verify = self.cost.t_draft(), self.cost.t_verify(self._context)
        fresh = self.learned.fresh
        base = min(baseline_ms, t_verify[1]) if fresh and baseline_ms is not None else None
        gain, hope = self.expected_gain(base)
        if gain <= 0:
            return 0
        g = max(1, best_gamma([hope ** i for i in range(1, self.longest(limit) + 1)], t_draft, t_verify,
                              self._rollback)[0])
        catch_up = self.cost.t_catch_up(self._lag, self._context)
        if fresh:
            left = float("inf") if self._left is None else self._left
            return g if catch_up <= gain * left * (t_verify[1] if base is None else base) else 0
        s = self.survival(None, 0)
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
