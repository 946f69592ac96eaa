"""Drafter chains (`--drafter ngram,model`): specs, llama.cpp's first-non-empty rule at a fixed γ, and
the chain scheduler measured in a cost-model simulator: a chain is never worse than its best member
alone. Greedy equality and the sampled distribution test with a chain are in test_lossless_reference."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest

from edgespec.drafters.base import Draft
from edgespec.drafters.chain import DrafterChain, members
from edgespec.drafters.history import HistoryDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.drafters.registry import open_drafter, plan_drafter
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams
from edgespec.schedule.chain import ChainScheduler
from edgespec.schedule.scheduler import K_MAX, Acceptance, CostModel, Scheduler

GREEDY = SamplingParams()


def test_a_comma_list_plans_a_chain_of_its_members():
    plan = plan_drafter("ngram:4,history", None)
    assert plan is not None and plan.kind == "chain"
    assert [m.kind for m in plan.members] == ["ngram", "history"] and plan.parts == plan.members
    assert plan_drafter("ngram", None).parts[0].kind == "ngram"  # one drafter: its own only part


@pytest.mark.parametrize("spec,why", [("ngram,", "two or more drafters"), ("ngram,none", "two or more"),
                                      ("ngram,ngram:x", "bad n-gram drafter 'ngram:x'"),
                                      ("ngram,no-such-model.gguf", "no-such-model.gguf")])
def test_a_bad_chain_is_a_one_line_error_naming_the_member(spec, why):
    with pytest.raises(EdgespecError) as e:
        plan_drafter(spec, None)
    assert why in str(e.value) and "\n" not in str(e.value)


class _Fixed:
    """Drafts `tokens` (cut to γ) and counts its calls."""

    def __init__(self, name: str, tokens: Sequence[int], paths: tuple[str, ...] = (), support: int | None = None
                 ) -> None:
        self.name, self.tokens, self.paths, self.calls, self.cleared, self.closed = name, list(tokens), paths, 0, 0, 0
        self.support = support  # the match length it reports, as n-gram does (None: none)

    def draft(self, context, gamma, params, rng, stop=None) -> Draft:
        self.calls += 1
        return Draft(self.tokens[:gamma], support=self.support if self.tokens else None)

    def cost_prior(self, note=None):
        return None

    def reset(self) -> None:
        pass

    def clear(self) -> None:
        self.cleared += 1

    def close(self) -> None:
        self.closed += 1


def test_at_a_fixed_gamma_the_first_non_empty_draft_is_verified():
    empty, a, b = _Fixed("empty", []), _Fixed("a", [1, 2, 3]), _Fixed("b", [4], ("b.gguf",))
    chain = DrafterChain([empty, a, b])
    assert chain.name == "empty,a,b" and chain.paths == ("b.gguf",) and members(chain) == (empty, a, b)
    d = chain.draft([0], 2, GREEDY, np.random.default_rng(0))
    assert d.tokens == [1, 2] and (empty.calls, a.calls, b.calls) == (1, 1, 0)
    assert DrafterChain([empty, _Fixed("e2", [])]).draft([0], 3, GREEDY, np.random.default_rng(0)).tokens == []
    chain.clear()
    chain.close()
    assert (empty.cleared, b.cleared, empty.closed, b.closed) == (1, 1, 1, 1)
    with pytest.raises(ValueError):
        DrafterChain([a])


def test_opening_a_chain_opens_each_member_and_the_serve_isolation_finds_its_history():
    from edgespec.backends.reference import ReferenceBackend

    chain = open_drafter("ngram,history", ReferenceBackend(6, seed=5))
    assert isinstance(chain, DrafterChain)
    assert isinstance(chain.members[0], NgramDrafter) and isinstance(chain.members[1], HistoryDrafter)
    assert next(m for m in members(chain) if isinstance(m, HistoryDrafter)) is chain.members[1]


# -- the simulator: a known output, drafters scripted against it, modeled costs --------------------


class _Copier:
    """A free drafter (n-gram-like): inside a copy stretch it drafts the true continuation to the
    stretch's end, elsewhere nothing; its support is the match so far (the stretch's tokens already
    emitted, at least 2 and at most 16, as n-gram's)."""

    name = "copier"
    paths = ()

    def __init__(self, truth: list[int], copy: np.ndarray) -> None:
        self.truth, self.copy = truth, copy

    def draft(self, context, gamma, params, rng, stop=None) -> Draft:
        p, out = len(context), []
        while len(out) < gamma and p + len(out) < len(self.truth) and self.copy[p + len(out)]:
            out.append(self.truth[p + len(out)])
        a = p
        while a > 0 and self.copy[a - 1] and p - a < 16:
            a -= 1
        return Draft(out, support=max(2, p - a) if out else None)

    def close(self) -> None:
        pass


class _Model:
    """A costly drafter right at each position with a fixed chance (a draft model or MTP head),
    with its confidence, honouring the stop rule; it remembers how far it has read."""

    name = "model"
    paths = ("model.gguf",)

    def __init__(self, truth: list[int], right: np.ndarray) -> None:
        self.truth, self.right, self.read = truth, right, 0

    def draft(self, context, gamma, params, rng, stop=None) -> Draft:
        p, out, conf = len(context), [], []
        while len(out) < gamma and p + len(out) < len(self.truth):
            conf.append(0.8)
            if stop is not None and stop(conf):
                conf.pop()
                break
            i = p + len(out)
            out.append(self.truth[i] if self.right[i] else -1)
        return Draft(out, None, conf, max(0, p - 1 - self.read))  # the context it caught up on

    def close(self) -> None:
        pass


def _simulate(drafter, sched, truth: list[int], start: int, t_verify: list[float], draft_ms: float) -> float:
    """Generate truth[start:] greedily with modeled costs; returns the speedup over plain steps.
    A costly drafter pays draft_ms per drafted token, and draft_ms / 4 per context token it missed
    (the catch-up the scheduler prices)."""
    rng, p, ms = np.random.default_rng(0), start, 0.0
    model = next((m for m in members(drafter) if isinstance(m, _Model)), None)
    sched.new_generation(start, len(truth) - start)
    while p < len(truth):
        d, _ = sched.draft(drafter, truth[:p], min(K_MAX - 1, len(truth) - p - 1), GREEDY, rng)
        n = 0
        while n < len(d.tokens) and d.tokens[n] == truth[p + n]:
            n += 1
        t_draft = 0.0
        if model is not None and d.confidence is not None and d.tokens:  # the model drafted
            t_draft = draft_ms * (len(d.tokens) + max(0, p - 1 - model.read) / 4)
            model.read = p + n
        ms += t_draft + t_verify[len(d.tokens) + 1]
        sched.observe(d, n, t_draft / 1000, t_verify[len(d.tokens) + 1] / 1000)
        sched.emitted(truth[p:p + n + 1])
        p += n + 1
    return (len(truth) - start) * t_verify[1] / ms


def _schedulers(t_verify: list[float], draft_ms: float) -> tuple[Scheduler, Scheduler]:
    t = {k: t_verify[k] for k in range(1, K_MAX + 1)}
    return Scheduler(CostModel(t)), Scheduler(CostModel(t, draft_ms))


@pytest.mark.parametrize("regime,slope,draft_ms,copy_share,right", [
    ("bandwidth-bound, copies and a good model", 0.5, 1.0, 0.3, 0.8),
    ("bandwidth-bound, no copies", 0.5, 1.0, 0.0, 0.8),
    ("bandwidth-bound, a weak model", 0.5, 3.0, 0.3, 0.3),
    ("compute-bound, copies", 5.0, 1.0, 0.3, 0.8),
])
def test_a_chain_is_never_worse_than_its_best_member_alone(regime, slope, draft_ms, copy_share, right):
    rng = np.random.default_rng(1)
    n, start = 3000, 50
    truth = [int(x) for x in rng.integers(0, 1000, n)]
    copy = np.zeros(n, bool)  # copy stretches of 20-60 tokens covering `copy_share` of the text
    while copy.mean() < copy_share:
        a = int(rng.integers(start, n - 60))
        copy[a:a + int(rng.integers(20, 60))] = True
    correct = rng.random(n) < right
    t_verify = [0.0] + [10.0 + slope * (k - 1) for k in range(1, K_MAX + 2)]
    speed = {}
    for name in ("copier", "model", "chain"):
        copier, model = _Copier(truth, copy), _Model(truth, correct)
        s_free, s_model = _schedulers(t_verify, draft_ms)
        drafter = {"copier": copier, "model": model, "chain": DrafterChain([copier, model])}[name]
        sched = {"copier": s_free, "model": s_model,
                 "chain": ChainScheduler([(copier, s_free), (model, s_model)])}[name]
        speed[name] = _simulate(drafter, sched, truth, start, t_verify, draft_ms)
    assert speed["chain"] >= 0.99 * max(speed["copier"], speed["model"]), (regime, speed)



class _Slow:
    """A costly drafter that takes `seconds` and proposes one token it has little confidence in."""

    name = "slow"
    paths = ("slow.gguf",)

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def draft(self, context, gamma, params, rng, stop=None) -> Draft:
        self.calls += 1
        time.sleep(self.seconds)
        return Draft([9] * gamma, None, [0.3] * gamma)

    def close(self) -> None:
        pass


def test_a_member_learns_its_own_drafting_time_and_a_sunk_draft_is_not_held_against_it():
    """A costly member that drafted and lost must not charge its time to the verified free member (that
    made n-gram "costly" for good in a chain); a drafted proposal competes on what verifying it still costs."""
    t = [0.0] + [10.0 + 0.5 * (k - 1) for k in range(1, K_MAX + 2)]
    costs = {k: t[k] for k in range(1, K_MAX + 1)}
    free, slow = _Fixed("free", [1, 2]), _Slow(0.02)
    s_free, s_slow = Scheduler(CostModel(costs)), Scheduler(CostModel(costs, draft_per_token_ms=3.0))
    s_free.learned.acceptance = Acceptance(prior=0.5, strength=1e9)  # E[tokens] 1.75 for 2 drafts
    s_free.learned.run, s_free.learned.recent = 100, 1.0
    s_slow.learned.acceptance, s_slow.learned.recent = Acceptance(prior=0.9, strength=1e9), 0.9
    chain = ChainScheduler([(free, s_free), (slow, s_slow)])
    for _ in range(3):
        t0 = time.perf_counter()
        d, dec = chain.draft(DrafterChain([free, slow]), [0, 1, 2], 8, GREEDY, np.random.default_rng(0))
        t_draft = time.perf_counter() - t0 - dec.seconds  # as the engine times it: the whole chain
        # the slow member's plan (≈3.4 tokens at 3 ms a draft) beat the free proposal, so it drafted;
        # its draft, cut by its low confidence, then verifies worse than the free one
        assert dec.member == "free" and d.tokens == [1, 2] and t_draft >= 0.02
        chain.observe(d, 2, t_draft, t[3] / 1000)
        chain.emitted([1, 2, 5])
    assert slow.calls == 3
    assert s_free.cost.free and s_free.cost.t_draft()[1] < 1.0  # the free member's cost is its own (µs), not 20 ms


def test_a_member_judged_off_still_probes_where_no_free_member_proposes():
    """Alone, a costly drafter the scheduler turned off probes again once plain steps have paid for it;
    in a chain whose free member has nothing to propose it must do the same (not stay off for good)."""
    t = [0.0] + [10.0 + 0.5 * (k - 1) for k in range(1, K_MAX + 2)]
    costs = {k: t[k] for k in range(1, K_MAX + 1)}

    def losing() -> Scheduler:
        s = Scheduler(CostModel(costs, draft_per_token_ms=3.0))
        s.learned.acceptance = Acceptance(prior=0.05, strength=1e9)
        return s

    probes = {}
    for name in ("alone", "chain"):
        free, slow, s_slow = _Fixed("free", []), _Slow(0.0), losing()
        sched = s_slow if name == "alone" else ChainScheduler([(free, Scheduler(CostModel(costs))), (slow, s_slow)])
        drafter = slow if name == "alone" else DrafterChain([free, slow])
        n = 0
        for step in range(400):
            d, dec = sched.draft(drafter, list(range(step + 3)), 8, GREEDY, np.random.default_rng(0))
            n += dec.probe
            sched.observe(d, 0, 0.0, t[len(d.tokens) + 1] / 1000)
            sched.emitted([7])
        probes[name] = (n, slow.calls)
    assert probes["alone"][0] > 0 and probes["chain"] == probes["alone"], probes


def test_a_chain_reads_a_new_prompt_into_its_model_only_if_that_beats_the_chain_without_it():
    """At a generation's start a draft model must read the prompt before it drafts. Alone, that pays
    when its drafts save more than the reading costs against plain steps; in a chain, against what the
    chain did without it in earlier generations (n-gram copying 3x: the model stays out)."""
    t = [0.0] + [10.0 + 0.5 * (k - 1) for k in range(1, K_MAX + 2)]
    costs = {k: t[k] for k in range(1, K_MAX + 1)}
    for free_ms, drafts in ((None, True), (8.0, True), (3.0, False)):
        free, slow = _Fixed("free", []), _Slow(0.0)
        s_slow = Scheduler(CostModel(costs, draft_per_token_ms=1.0, catch_up_ms=0.5))
        s_slow.learned.acceptance = Acceptance(prior=0.9, strength=1e9)
        s_slow.learned.run, s_slow.learned.recent = 100, 0.9  # ~6 tokens per 21 ms cycle: 3.5 ms a token
        chain = ChainScheduler([(free, Scheduler(CostModel(costs))), (slow, s_slow)])
        chain.new_generation(200, 100)  # reading the prompt: 100 ms
        chain.free_ms = free_ms
        d, _ = chain.draft(DrafterChain([free, slow]), list(range(201)), 8, GREEDY, np.random.default_rng(0))
        assert bool(d.tokens) == drafts, free_ms

    # what the chain did without its model is learned from the cycles no costly draft was verified in
    free, slow = _Fixed("free", [5, 6, 7]), _Slow(0.0)
    chain = ChainScheduler([(free, Scheduler(CostModel(costs))), (slow, Scheduler(CostModel(costs, 1.0)))])
    chain.new_generation(10, 100)
    ms = tokens = 0.0
    for _ in range(10):
        d, dec = chain.draft(DrafterChain([free, slow]), [0, 1, 2], 8, GREEDY, np.random.default_rng(0))
        chain.observe(d, len(d.tokens), 0.0, t[len(d.tokens) + 1] / 1000)
        chain.emitted([*d.tokens, 9])
        ms, tokens = ms + t[len(d.tokens) + 1], tokens + len(d.tokens) + 1
        assert dec.member == "free"
    assert chain.free_ms is None
    chain.new_generation(10, 100)
    assert chain.free_ms == pytest.approx(ms / tokens, rel=1e-3) and chain.free_ms < t[1] / 2


def test_a_long_copy_after_a_miss_is_verified_without_asking_the_costly_member():
    """Right after a miss, an n-gram proposal copying from a 16-token match is the rest of a copy (a
    trace of SmolLM2 F32 code edits: 97% right at the first token, against 53% for matches under 8).
    Keyed on its run of right drafts (0 after the miss) it looked weak, the draft model's plan beat it,
    and the model drafted 14 tokens for 150 ms where the copy gave 15 for free: the chain ran at 0.6 of
    n-gram alone. Keyed on its match, the copy wins before the model is asked; a short match does not."""
    t = [0.0] + [10.0 + 0.5 * (k - 1) for k in range(1, K_MAX + 2)]
    costs = {k: t[k] for k in range(1, K_MAX + 1)}
    for support, model_asked in ((16, False), (2, True)):
        free, slow = _Fixed("ngram", list(range(100, 115)), support=support), _Slow(0.0)
        s_free = Scheduler(CostModel(costs))
        s_free.learned.acceptance = Acceptance(prior=0.97, strength=1e9)
        s_free.learned.run, s_free.learned.recent = 0, 0.97  # a miss just now
        s_slow = Scheduler(CostModel(costs, draft_per_token_ms=0.2))
        s_slow.learned.acceptance = Acceptance(prior=0.97, strength=1e9)
        s_slow.learned.run, s_slow.learned.recent = 100, 0.97
        chain = ChainScheduler([(free, s_free), (slow, s_slow)])
        d, dec = chain.draft(DrafterChain([free, slow]), list(range(50)), K_MAX - 1, GREEDY,
                             np.random.default_rng(0))
        assert (slow.calls > 0) == model_asked, support
        if not model_asked:
            assert dec.member == "ngram" and len(d.tokens) >= 10
