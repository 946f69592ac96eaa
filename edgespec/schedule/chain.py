"""`-k auto` over a drafter chain (edgespec.drafters.chain.DrafterChain): each member keeps its own
scheduler, so its own acceptance and cost, and per cycle the proposal with the best expected rate is
verified:

1. free members (n-gram, history: microseconds) draft first; each proposal's expected rate is its
   scheduler's E[tokens] / expected ms for the γ it keeps (a plain step's rate when it keeps none);
2. a costly member (a draft model, a head, MTP) is planned without drafting (`Scheduler.plan`, before
   any confidence is known) and drafts only if that plan beats the best free proposal; of several
   costly members only the best planned one may draft;
3. the winner is verified. Exactness needs nothing more: a draft's q is the distribution of the
   drafter that made it, and which drafter proposes is decided before verification sees the target.

Every member sees the accepted tokens: each drafter syncs to the whole context on its next call (a
draft model catches up on what it skipped, which its scheduler prices: `Scheduler.emitted` counts the
lag), and every member's scheduler scores the emitted tokens (free members' unverified drafts are
scored in shadow, as when they run alone). A member's scheduler is the one it has alone
(`Pricing.scheduler`), so what a pair learned carries between a chain and its members.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edgespec.drafters.base import Draft, Drafter
from edgespec.drafters.chain import DrafterChain
from edgespec.sampling import Dist, SamplingParams
from edgespec.schedule.rate import Decision
from edgespec.schedule.scheduler import Scheduler


@dataclass
class ChainScheduler:
    """The Scheduler interface the engine uses (draft, observe, emitted, new_generation) over one
    scheduler per member: each cycle verifies the member proposal with the best expected rate."""

    schedulers: list[tuple[Drafter, Scheduler]]
    chosen: Scheduler | None = None  # the member whose draft the current cycle verifies (None: plain)
    others_s: float = 0.0  # the cycle's drafting time spent by members whose proposal is not verified
    by_member: dict[str, int] = field(default_factory=dict)  # cycles verified per member's name
    # per member: the context tokens it caught up on (Draft.synced) at its latest draft after its
    # first in a generation: its plan pays for that catch-up again (the current lag is sunk: waiting
    # only makes it grow; the prompt's reading is priced by its scheduler)
    lag: list[int] = field(default_factory=list)
    started: list[bool] = field(default_factory=list)  # per member: drafted in this generation
    # ms per token of the cycles no costly member's draft was verified in (plain steps and free members'
    # drafts) in the latest generation that had any (None: not known yet): what a costly member must
    # beat to be worth reading a new prompt
    free_ms: float | None = None
    _free: list[float] = field(default_factory=lambda: [0.0, 0.0])  # this generation's (ms, tokens)
    _costly_s: float = 0.0  # the cycle's drafting time spent by costly members

    def __post_init__(self) -> None:
        self.lag, self.started = [0] * len(self.schedulers), [False] * len(self.schedulers)

    def draft(self, drafter: DrafterChain, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator) -> tuple[Draft, Decision]:
        best: tuple[float, Scheduler | None, Draft, Decision, float] | None = None  # (rate, who, ..., seconds)
        costly: tuple[float, int, float | None] | None = None  # (planned rate, member index, baseline)
        spent = 0.0
        for i, (m, s) in enumerate(self.schedulers):
            if not s.cost.free:
                base = None if self.started[i] else self.free_ms
                _, rate = s.plan(len(context) - 1, limit, s.cost.t_catch_up(self.lag[i], len(context) - 1), base)
                if costly is None or rate > costly[0]:
                    costly = (rate, i, base)
                continue
            t0 = time.perf_counter()
            d, dec = s.draft(m, context, limit, params, rng)
            seconds = time.perf_counter() - t0 - dec.seconds
            spent += seconds
            if best is None or (d.tokens and dec.rate > best[0]):
                best = (dec.rate, s if d.tokens else None, d, dec, seconds)
        # a costly member drafts only if its plan, paying for the drafting, beats what is already drafted;
        # where nothing is, it is asked as if alone (a member judged off still probes when its turn comes)
        if costly is not None and (best is None or costly[0] > best[0] or not best[2].tokens):
            i = costly[1]
            m, s = self.schedulers[i]
            t0 = time.perf_counter()
            d, dec = s.draft(m, context, limit, params, rng, costly[2])
            if dec.gamma or d.tokens:  # it drafted, after reading what it had missed
                if self.started[i]:
                    self.lag[i] = d.synced
                self.started[i] = True
            # then its drafting is sunk: proposals compare on what verifying them still costs; a probe
            # is verified whatever it promises (that is how its scheduler learns)
            seconds = time.perf_counter() - t0 - dec.seconds
            spent += seconds
            self._costly_s = seconds
            if best is None or (d.tokens and (dec.probe or dec.rate > best[0])):
                best = (dec.rate, s if d.tokens else None, d, dec, seconds)
        else:
            self._costly_s = 0.0
        assert best is not None
        _, self.chosen, d, dec, own = best
        self.others_s = spent - own
        if self.chosen is not None:
            dec.member = next(m.name for m, s in self.schedulers if s is self.chosen)
            self.by_member[dec.member] = self.by_member.get(dec.member, 0) + 1
        return d, dec

    def observe(self, draft: Draft, accepted: int, t_draft: float, t_verify: float,
                context: int | None = None, rollback: float = 0.0) -> None:
        """The verified member learns from its cycle, its cost from `t_draft` (the whole chain's drafting)
        less the other members' time; after a plain step, every member does (each would have seen one
        alone)."""
        if self._free_cycle:
            self._free[0] += 1000 * (max(0.0, t_draft - self._costly_s) + t_verify)
        if self.chosen is not None:
            self.chosen.observe(draft, accepted, max(0.0, t_draft - self.others_s), t_verify, context, rollback)
            return
        for _, s in self.schedulers:
            s.observe(draft, accepted, t_draft, t_verify, context, rollback)

    def emitted(self, tokens: Sequence[int], probs: Sequence[Dist | np.ndarray] | None = None) -> None:
        for _, s in self.schedulers:
            s.emitted(tokens, probs)
        if self._free_cycle:
            self._free[1] += len(tokens)

    @property
    def _free_cycle(self) -> bool:
        """Whether the current cycle verified no costly member's draft."""
        return self.chosen is None or self.chosen.cost.free

    def new_generation(self, n_prompt: int, max_tokens: int | None = None) -> None:
        """Each member's own (a costly member's scheduler prices reading the prompt, against what the
        chain did without costly members in earlier generations)."""
        ms, tokens = self._free
        if tokens:
            self.free_ms = ms / tokens
        self._free = [0.0, 0.0]
        self.started = [False] * len(self.schedulers)
        for _, s in self.schedulers:
            s.new_generation(n_prompt, max_tokens)
