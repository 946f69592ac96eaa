"""What a target and its drafters cost, for the scheduler: the assembler's price phase.

One `Pricing` per target holds its cost profile (T(k), what each cached token adds, the largest
exact verification batch: edgespec.calibration, cached per model) and each drafter's cost prior
(`Drafter.cost_prior`), and builds a Scheduler per (drafter, sampling mode) from them and from the
acceptance the pair showed before (calibration.pair_path). The Engine asks it for the scheduler
and for how many tokens one verification forward may take; nothing else in the loop prices.

Schedulers learn from the text they schedule (acceptance, and the timings of the γ and contexts it
led to), so a server keeps them per client (`use`, edgespec.server.isolation): each scope has its
own, built fresh from the shared profile and priors (measured before any request, on tokens of
their own), and a scope other than the engine's own (None) neither reads nor writes the pair record,
which would carry one client's acceptance to another.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path

from edgespec.backends.base import Backend
from edgespec.calibration import CostProfile, pair_path
from edgespec.drafters.base import DraftCost, Drafter
from edgespec.drafters.chain import DrafterChain, members
from edgespec.schedule.chain import ChainScheduler
from edgespec.schedule.scheduler import CostModel, Scheduler

MIN_CHUNK = 4  # the smallest verification split worth making (see Pricing.chunk)
MAX_SCOPES = 64  # scopes whose schedulers are kept besides the engine's own (~70 KiB a scheduler; least recently used go)

Note = Callable[[str], None] | None


class Pricing:
    """The costs the scheduler starts from, measured once per target (and cached per model)."""

    def __init__(self, target: Backend) -> None:
        self.target = target
        self.exact: int | None = None  # most tokens one verification forward may take and stay exact
        self.t_forward: dict[int, float] | None = None  # T(k) in ms after CONTEXT_TOKENS cached tokens
        self.ctx_ms = 0.0  # what each cached token adds to each verified token's time (ms)
        self.draft_cost: dict[Drafter, DraftCost | None] = {}
        self._scope: Hashable = None  # whose schedulers `scheduler` hands out (None: the engine's own)
        # per scope, its schedulers by (drafter, greedy): a chain's ChainScheduler, a member's Scheduler
        self._learned: OrderedDict[Hashable, dict[tuple[Drafter, bool], Scheduler | ChainScheduler]] = \
            OrderedDict({None: {}})

    @property
    def chunk(self) -> int | None:
        """Most tokens one verification forward takes (None: no limit). A target exact only below
        MIN_CHUNK tokens (F16 weights on CPU) is not split: that would rule speculation out, and its
        deviations are near-ties (docs/known-limits.md)."""
        return self.exact if self.exact and self.exact >= MIN_CHUNK else None

    def measure_exact_batch(self, note: Note = None, stop: threading.Event | None = None) -> None:
        """How many tokens one verification forward may take (cached per model after the first time).
        Uses the target's KV cache: the caller holds the engine and resets it. `stop`: as `calibrate`."""
        if self.exact is None:
            from edgespec.calibration import exact_batch

            self.exact = exact_batch(self._timed(stop), note=note)
            self.target.truncate(0)

    def calibrate(self, drafter: Drafter | None, note: Note = None, stop: threading.Event | None = None) -> None:
        """Load (or time, and cache per model) T(k) in ≤ 2 s, what each cached token adds in ~2–3 s,
        and `drafter`'s cost prior (a draft model times its own T(1), a feature head its chain step
        or block; n-gram is free). Uses the target's KV cache, as `measure_exact_batch`. `stop`: an
        idle run (schedule.first_use) raises Interrupted within one forward once it is set; what
        was measured by then is kept (cached), and nothing half-measured is taken as known."""
        from edgespec.calibration import calibrate, context_cost
        from edgespec.schedule.first_use import Interrupted

        self.measure_exact_batch(note, stop)
        if self.t_forward is None:  # timed in the forwards verification makes (Engine._verify_pass)
            target = self._timed(stop)
            t_forward = calibrate(target, note=note, chunk=self.chunk)
            ctx_ms = context_cost(target, chunk=self.chunk, note=note)
            self.target.truncate(0)
            self.t_forward, self.ctx_ms = t_forward, ctx_ms
        for d in members(drafter):  # a chain is priced member by member
            if d not in self.draft_cost:
                if stop is not None and stop.is_set():
                    raise Interrupted
                self.draft_cost[d] = d.cost_prior(note=note)

    def unknown(self) -> bool:
        """Whether the target's costs are neither known here nor cached on this machine: its next
        auto generation then decodes plainly and learns them (schedule.first_use)."""
        from edgespec.schedule.first_use import needs_learning

        return self.t_forward is None and needs_learning(self.target)

    def _timed(self, stop: threading.Event | None) -> Backend:
        """The target as calibration times it: stopped by `stop` within one forward (when given)."""
        if stop is None:
            return self.target
        from edgespec.schedule.first_use import Interruptible

        return Interruptible(self.target, stop)  # type: ignore[return-value]

    @property
    def costs(self) -> CostProfile | None:
        """What calibration measured (None before it ran): T(k), the context term, the exact batch."""
        if self.t_forward is None:
            return None
        from edgespec.calibration import backend_version

        t = self.target
        return CostProfile(t.path, "", t.name, backend_version(t), t.threads, dict(self.t_forward),
                           exact_batch=self.exact, context_ms=self.ctx_ms)

    def use(self, scope: Hashable) -> None:
        """Hand out `scope`'s own schedulers from now on: what they learn (acceptance, and costs as
        timed) stays in the scope. A scope never seen starts cold, from the profile and the priors
        only; None, the default, is the engine's own, the only one that reads and adds to the pair
        record. At most MAX_SCOPES others are kept (the least recently used is forgotten first)."""
        self._scope = scope
        self._learned.setdefault(scope, {})
        self._learned.move_to_end(scope)
        while len(self._learned) > MAX_SCOPES + 1:
            oldest = next(k for k in self._learned if k is not None)
            del self._learned[oldest]

    def forget(self, scope: Hashable) -> None:
        """Forget what `scope`'s schedulers learned: its next generation starts cold."""
        if scope in self._learned:
            self._learned[scope] = {}

    def scheduler(self, drafter: Drafter, greedy: bool) -> Scheduler | ChainScheduler:
        """The current scope's scheduler for this drafter and sampling mode (acceptance differs with
        temperature); it keeps what it learned across generations, and the engine's own starts from
        what the pair showed before. A chain's is one over its members' own schedulers
        (drafters.chain)."""
        learned, key = self._learned[self._scope], (drafter, greedy)
        if key in learned:
            return learned[key]
        if isinstance(drafter, DrafterChain):
            learned[key] = ChainScheduler([(m, self.scheduler(m, greedy)) for m in drafter.members])
            return learned[key]
        from edgespec.calibration import CONTEXT_TOKENS, load_acceptance

        self.calibrate(drafter)
        assert self.t_forward is not None
        cost = CostModel.for_drafter(self.t_forward, self.draft_cost.get(drafter), ctx_ms=self.ctx_ms,
                                     base_context=CONTEXT_TOKENS, recurrent=self.target.recurrent)
        prior = load_acceptance(self.pair_path(drafter, greedy)) if self._scope is None else None
        learned[key] = Scheduler(cost, prior)
        return learned[key]

    def remember(self, drafter: Drafter, greedy: bool) -> None:
        """Keep what the generation just ended showed of this pair's acceptance (each chain member's
        with the target), for the next engine: the engine's own scope only (`use`)."""
        from edgespec.calibration import save_acceptance

        if self._scope is not None:
            return
        learned = self._learned[None]
        for d in members(drafter):
            if isinstance(s := learned.get((d, greedy)), Scheduler):
                save_acceptance(self.pair_path(d, greedy), *s.learned.generation_judged())

    def pair_path(self, drafter: Drafter, greedy: bool) -> Path | None:
        """Where what the scheduler learned of this (target, drafter) pair's acceptance is kept."""
        return pair_path(self.target, drafter.paths, greedy)
