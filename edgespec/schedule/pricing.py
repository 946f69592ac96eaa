"""What a target and its drafters cost, for the scheduler: the assembler's price phase.

One `Pricing` per target holds its cost profile (T(k), what each cached token adds, the largest
exact verification batch: edgespec.calibration, cached per model) and each drafter's cost prior
(`Drafter.cost_prior`), and builds a Scheduler per (drafter, sampling mode) from them and from the
acceptance the pair showed before (calibration.pair_path). The Engine asks it for the scheduler
and for how many tokens one verification forward may take; nothing else in the loop prices.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from edgespec.backends.base import Backend
from edgespec.calibration import CostProfile, pair_path
from edgespec.drafters.base import DraftCost, Drafter
from edgespec.drafters.chain import DrafterChain, members
from edgespec.schedule.chain import ChainScheduler
from edgespec.schedule.scheduler import CostModel, Scheduler

MIN_CHUNK = 4  # the smallest verification split worth making (see Pricing.chunk)

Note = Callable[[str], None] | None


class Pricing:
    """The costs the scheduler starts from, measured once per target (and cached per model)."""

    def __init__(self, target: Backend) -> None:
        self.target = target
        self.exact: int | None = None  # most tokens one verification forward may take and stay exact
        self.t_forward: dict[int, float] | None = None  # T(k) in ms after CONTEXT_TOKENS cached tokens
        self.ctx_ms = 0.0  # what each cached token adds to each verified token's time (ms)
        self.draft_cost: dict[Drafter, DraftCost | None] = {}
        self._schedulers: dict[tuple[Drafter, bool], Scheduler] = {}
        self._chains: dict[tuple[Drafter, bool], ChainScheduler] = {}

    @property
    def chunk(self) -> int | None:
        """Most tokens one verification forward takes (None: no limit). A target exact only below
        MIN_CHUNK tokens (F16 weights on CPU) is not split: that would rule speculation out, and its
        deviations are near-ties (docs/known-limits.md)."""
        return self.exact if self.exact and self.exact >= MIN_CHUNK else None

    def measure_exact_batch(self, note: Note = None) -> None:
        """How many tokens one verification forward may take (cached per model after the first time).
        Uses the target's KV cache: the caller holds the engine and resets it."""
        if self.exact is None:
            from edgespec.calibration import exact_batch

            self.exact = exact_batch(self.target, note=note)
            self.target.truncate(0)

    def calibrate(self, drafter: Drafter | None, note: Note = None) -> None:
        """Load (or time, and cache per model) T(k) in ≤ 2 s, what each cached token adds in ~2–3 s,
        and `drafter`'s cost prior (a draft model times its own T(1), a feature head its chain step
        or block; n-gram is free). Uses the target's KV cache, as `measure_exact_batch`."""
        from edgespec.calibration import calibrate, context_cost

        self.measure_exact_batch(note)
        if self.t_forward is None:  # timed in the forwards verification makes (Engine._verify_pass)
            self.t_forward = calibrate(self.target, note=note, chunk=self.chunk)
            self.ctx_ms = context_cost(self.target, chunk=self.chunk, note=note)
            self.target.truncate(0)
        for d in members(drafter):  # a chain is priced member by member
            if d not in self.draft_cost:
                self.draft_cost[d] = d.cost_prior(note=note)

    @property
    def costs(self) -> CostProfile | None:
        """What calibration measured (None before it ran): T(k), the context term, the exact batch."""
        if self.t_forward is None:
            return None
        from edgespec.calibration import backend_version

        t = self.target
        return CostProfile(t.path, "", t.name, backend_version(t), t.threads, dict(self.t_forward),
                           exact_batch=self.exact, context_ms=self.ctx_ms)

    def scheduler(self, drafter: Drafter, greedy: bool) -> Scheduler | ChainScheduler:
        """The scheduler for this drafter and sampling mode (acceptance differs with temperature);
        it keeps what it learned across generations, and starts from what the pair showed before.
        A chain's is one over its members' own schedulers (drafters.chain)."""
        if isinstance(drafter, DrafterChain):
            key = (drafter, greedy)
            if key not in self._chains:
                self._chains[key] = ChainScheduler([(m, self.scheduler(m, greedy)) for m in drafter.members])
            return self._chains[key]
        key = (drafter, greedy)
        if key not in self._schedulers:
            from edgespec.calibration import CONTEXT_TOKENS, load_acceptance

            self.calibrate(drafter)
            assert self.t_forward is not None
            cost = CostModel.for_drafter(self.t_forward, self.draft_cost.get(drafter), ctx_ms=self.ctx_ms,
                                         base_context=CONTEXT_TOKENS, recurrent=self.target.recurrent)
            record = load_acceptance(self.pair_path(drafter, greedy))
            self._schedulers[key] = Scheduler(cost, *(record or (None,)))
        return self._schedulers[key]

    def remember(self, drafter: Drafter, greedy: bool) -> None:
        """Keep what the generation just ended showed of this pair's acceptance (each chain member's
        with the target), for the next engine."""
        from edgespec.calibration import save_acceptance

        for d in members(drafter):
            if (d, greedy) in self._schedulers:
                save_acceptance(self.pair_path(d, greedy), *self._schedulers[d, greedy].generation_judged())

    def pair_path(self, drafter: Drafter, greedy: bool) -> Path | None:
        """Where what the scheduler learned of this (target, drafter) pair's acceptance is kept."""
        return pair_path(self.target, drafter.paths, greedy)
