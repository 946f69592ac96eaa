"""The scheduler's decision rule on synthetic cost and acceptance curves with hand-derived optima,
its learning (acceptance, costs, confidence), and its off-switch for a drafter that is always wrong."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.drafters.base import Draft
from edgespec.sampling import SamplingParams
from edgespec.schedule.scheduler import (
    COSTLY_GAMMA,
    K_MAX,
    Acceptance,
    CostModel,
    RobustTime,
    Scheduler,
    best_gamma,
)

GREEDY = SamplingParams()


def _linear(c0: float, c1: float) -> list[float]:
    """T(k) = c0 + c1·(k − 1) for k = 1..K_MAX (index 0 unused)."""
    return [0.0] + [c0 + c1 * (k - 1) for k in range(1, K_MAX + 1)]


def _const(alpha: float, n: int) -> list[float]:
    return np.cumprod([alpha] * n).tolist()


def test_linear_cost_constant_acceptance_optimum():
    # T(k) = 1 + 0.5(k−1), α = 0.9: E[tokens|γ] = (1 − 0.9^{γ+1}) / 0.1, rate = E / (1 + 0.5γ):
    # γ=0: 1.000, γ=1: 1.900/1.5 = 1.267, γ=2: 2.710/2 = 1.355, γ=3: 3.439/2.5 = 1.376, γ=4: 4.095/3 = 1.365
    g, rate = best_gamma(_const(0.9, 10), [0.0] * K_MAX, _linear(1.0, 0.5))
    assert g == 3 and rate == pytest.approx(3.439 / 2.5, rel=1e-6)


def test_draft_cost_moves_the_optimum():
    # T(k) = 1 + 0.2(k−1), 0.3 per draft token, α = 0.8: cost(γ) = 1 + 0.5γ,
    # E = 1, 1.8, 2.44, 2.952, 3.362 → rates 1, 1.2, 1.22, 1.181, 1.120: γ* = 2
    g, _ = best_gamma(_const(0.8, 10), [0.3 * i for i in range(K_MAX)], _linear(1.0, 0.2))
    assert g == 2


def test_no_batching_gain_means_plain_steps():
    # T(k) = k: verifying k tokens costs k plain steps, so any α < 1 loses: γ* = 0
    assert best_gamma(_const(0.95, 10), [0.0] * K_MAX, _linear(1.0, 1.0))[0] == 0


def test_certain_acceptance_and_cheap_verification_drafts_to_the_limit():
    assert best_gamma(_const(1.0, 7), [0.0] * K_MAX, _linear(1.0, 0.1))[0] == 7


def test_acceptance_learns_per_position_and_unseen_positions_borrow():
    acc = Acceptance(prior=0.5, strength=1.0, decay=0.9)
    for _ in range(60):  # position 1 always accepted, position 2 never
        acc.observe(drafted=3, accepted=1)
    a, n = acc.rates, sum(0.9**i for i in range(60))  # n: the decayed count of tries
    assert a[0] == pytest.approx((n + 0.5) / (n + 1))  # (hits + strength·prior) / (tries + strength)
    assert a[1] == pytest.approx(a[0] / (n + 1))  # its prior is position 1's estimate
    assert a[2] == pytest.approx(a[1], abs=1e-9)  # never reached: borrows position 2's estimate


def test_robust_time_ignores_one_outlier_and_follows_a_shift():
    t = RobustTime()
    for x in [10, 10, 10, 500, 10]:
        t.add(x)
    assert t.value == pytest.approx(10)
    for _ in range(15):
        t.add(20)
    assert t.value == pytest.approx(20, rel=0.05)


def test_cost_model_scales_unmeasured_k_with_the_machine():
    cost = CostModel({1: 10.0, 2: 20.0, 4: 30.0})
    assert cost.t_verify()[3] == pytest.approx(25.0)  # interpolated prior
    for _ in range(10):  # the machine got 2× slower at k = 1
        cost.observe_verify(1, 20.0)
    assert cost.t_verify()[1] == pytest.approx(20.0)
    assert cost.t_verify()[4] == pytest.approx(60.0, rel=0.05)


def test_cost_model_adds_attention_for_the_context():
    # T(k) after 64 cached tokens, plus 0.01 ms per verified token per cached token beyond 64
    cost = CostModel({1: 10.0, 2: 12.0, 4: 16.0}, ctx_ms=0.01, base_context=64)
    assert cost.t_verify(10) == cost.t_verify()  # below the profile's context: no credit
    assert cost.t_verify(1064)[4] == pytest.approx(16.0 + 4 * 0.01 * 1000)
    for _ in range(10):  # timed after 1064 tokens: 56 ms is the prior's 16 plus attention
        cost.observe_verify(4, 56.0, context=1064)
    assert cost.t_verify()[4] == pytest.approx(16.0)
    assert cost.scale.value == pytest.approx(1.0)  # so the machine did not slow down
    assert cost.t_verify(2064)[1] == pytest.approx(10.0 + 1 * 0.01 * 2000)
    assert cost.t_verify(2064)[4] == pytest.approx(16.0 + 4 * 0.01 * 2000)


def test_a_long_context_shortens_the_best_draft():
    # T(k) = 1 + 0.1(k−1) after 64 tokens, α = 0.9, E(γ) = (1 − 0.9^{γ+1}) / 0.1:
    # after 64 tokens, rate = E / (1 + 0.1γ): γ=9 6.513/1.9 = 3.428, γ=10 6.862/2.0 = 3.431,
    #   γ=11 7.176/2.1 = 3.417 → γ* = 10
    # after 1064 tokens each verified token adds 0.001·1000 = 1 ms: rate = E / (2 + 1.1γ):
    #   γ=2 2.710/4.2 = 0.645, γ=3 3.439/5.3 = 0.649, γ=4 4.095/6.4 = 0.640 → γ* = 3
    t = _linear(1.0, 0.1)
    cost = CostModel({k: t[k] for k in range(1, K_MAX + 1)}, ctx_ms=0.001, base_context=64)
    assert best_gamma(_const(0.9, 15), [0.0] * K_MAX, cost.t_verify(64))[0] == 10
    assert best_gamma(_const(0.9, 15), [0.0] * K_MAX, cost.t_verify(1064))[0] == 3
    # the scheduler plans with the context it is given (its cache: all but the pending token)
    sched = Scheduler(cost)
    sched.learned.acceptance = Acceptance(prior=0.9, strength=1e9)  # α = 0.9 everywhere
    sched.learned.run, sched.learned.recent = 100, 1.0  # a long run of right drafts: no slow start, no recent cap
    short = sched.draft(_ScriptedDrafter(token=0), [1] * 65, K_MAX - 1, GREEDY, np.random.default_rng(0))
    long = sched.draft(_ScriptedDrafter(token=0), [1] * 1065, K_MAX - 1, GREEDY, np.random.default_rng(0))
    assert short[1].gamma == 10 and long[1].gamma == 3


class _ScriptedDrafter:
    """Drafts `n` fixed tokens with the given confidences, honouring the stop rule."""

    name = "scripted"

    def __init__(self, token: int, confidence: list[float] | None = None, n: int = K_MAX,
                 support: int | None = None) -> None:
        self.token, self.confidence, self.n, self.calls = token, confidence, n, 0
        self.support = support  # the match length it reports, as a copying drafter does (None: none)

    def draft(self, context, gamma, params, rng, stop=None) -> Draft:
        self.calls += 1
        tokens, conf = [], []
        while len(tokens) < min(gamma, self.n):
            conf.append(self.confidence[len(tokens)] if self.confidence else 1.0)  # before drawing
            if stop is not None and stop(conf):
                conf.pop()
                break
            tokens.append(self.token)
        return Draft(tokens, None, conf if self.confidence else None, support=self.support)

    def close(self) -> None:
        pass


def _simulate(sched: Scheduler, drafter, t_verify: list[float], draft_ms: float, cycles: int,
              target_token: int = 0) -> list[int]:
    """Run cycles against a target that always emits `target_token`; returns γ verified per cycle."""
    rng, gammas = np.random.default_rng(0), []
    for _ in range(cycles):
        d, _ = sched.draft(drafter, [1, 2, 3], K_MAX - 1, GREEDY, rng)
        n = 0
        while n < len(d.tokens) and d.tokens[n] == target_token:
            n += 1
        sched.observe(d, n, draft_ms * len(d.tokens) / 1000, t_verify[len(d.tokens) + 1] / 1000)
        sched.emitted([*d.tokens[:n], target_token])
        gammas.append(len(d.tokens))
    return gammas


@pytest.mark.parametrize("draft_ms", [0.0, 6.0])  # free (n-gram-like: shadow) and costly (probes)
def test_an_always_wrong_drafter_converges_to_plain_steps(draft_ms):
    t = _linear(10.0, 2.0)  # verification is cheap: speculation would pay if drafts were any good
    sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_ms))
    sched.learned.acceptance = Acceptance(prior=0.9)  # optimistic: it speculates at first
    gammas = _simulate(sched, _ScriptedDrafter(token=7), t, draft_ms, cycles=300)
    first_plain = next(i for i, g in enumerate(gammas) if g == 0)
    assert first_plain <= 10
    later = [g for g in gammas[first_plain:] if g > 0]
    # free drafter: scored in shadow, never verified again; costly: a few probes on a 2% budget
    assert len(later) <= (0 if draft_ms == 0 else 5)


def test_a_good_free_drafter_is_found_from_shadow_drafts():
    t = _linear(10.0, 2.0)
    sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}))
    sched.learned.acceptance = Acceptance(prior=0.05)  # pessimistic: plain steps, shadow drafts
    gammas = _simulate(sched, _ScriptedDrafter(token=0), t, 0.0, cycles=40)
    assert gammas[0] == 0 and gammas[-1] >= 8


def test_confidence_stops_drafting_when_one_more_token_does_not_pay():
    t = _linear(10.0, 2.0)
    sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=1.0))
    sched.learned.acceptance = Acceptance(prior=0.9)
    drafter = _ScriptedDrafter(token=0, confidence=[0.95, 0.95, 0.05, 0.95, 0.95, 0.95])
    d, plan = sched.draft(drafter, [1, 2, 3], K_MAX - 1, GREEDY, np.random.default_rng(0))
    assert d.tokens == [0, 0]  # saw position 3's confidence of 0.05 and drew no more
    assert plan.gamma == 2 and plan.tokens == pytest.approx(1 + 0.95 + 0.95**2)
    assert 0 < plan.seconds < 0.05  # the decision is timed (microseconds; measured, not asserted tight)


def test_a_block_drafter_pays_for_every_row_whatever_the_cut():
    # T(k) = 10 + (k−1), block F = 4: plan (a = 0.5 [recent cap], 0.9, 0.9, 0.9; slow start γ ≤ 4):
    #   E = 1, 1.5, 1.95, 2.355, 2.7195 over 10, 15, 16, 17, 18 ms → γ = 4 (0.1511 per ms): 4 rows
    # confidences 1.0, 0.05: S = 1, 0.05, 0.045, 0.0405 and every cut costs 4 + T(γ+1) (rows are sunk):
    #   E = 1, 2, 2.05, 2.095, 2.1355 over 14, 15, 16, 17, 18 → γ = 1 (0.1333), so it stops at position 2
    t = _linear(10.0, 1.0)
    sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_fixed_ms=4.0, block=True))
    sched.learned.acceptance = Acceptance(prior=0.9)
    drafter = _ScriptedDrafter(token=0, confidence=[1.0, 0.05, 1.0, 1.0])
    d, plan = sched.draft(drafter, [1, 2, 3], K_MAX - 1, GREEDY, np.random.default_rng(0))
    assert d.tokens == [0] and plan.gamma == 1 and plan.tokens == pytest.approx(2.0)
    assert plan.ms == pytest.approx(4.0 + t[2])  # the whole block's cost, one row verified
    sched.observe(d, 1, 0.006, 0.011)
    assert sched.cost.draft_at[4].n == 1 and sched.cost.draft_at[1].n == 0  # learned as a 4-row block


def test_a_probe_pays_for_the_context_the_drafter_missed():
    t = _linear(10.0, 2.0)

    def probes(catch_up_ms_per_token: float) -> int:
        sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=3.0),
                          prior=0.3)  # a weak pair: plain steps; it might yet win ~1.04x, so it is probed
        sched.cost.catch_up.add(catch_up_ms_per_token)
        sched.new_generation(n_prompt=500)  # a prompt the draft model has not read
        return sum(g > 0 for g in _simulate(sched, _ScriptedDrafter(token=7), t, 3.0, cycles=300))

    # 300 plain steps = 3 s; probes may lose PROBE_SHARE × 0.04 of it, ~30 ms: a probe's own loss is a
    # few ms, plus the catch-up
    assert probes(0.01) >= 1  # re-reading ~500-800 tokens costs 5-8 ms: it probes
    assert probes(1.0) == 0  # 500+ ms: it does not


def test_ngram_support_is_the_match_length():
    from edgespec.drafters.ngram import NgramDrafter

    d = NgramDrafter().draft([9, 1, 2, 3, 4, 5, 6, 8, 0, 1, 2, 3, 4, 5, 6], 3, GREEDY, np.random.default_rng(0))
    assert d.tokens == [8, 0, 1] and d.support == 6  # "1 2 3 4 5 6" matched, "9" vs "0" did not


def test_sampled_shadow_scoring_credits_p_of_the_draft_token():
    """Sampled: a shadow draft token the target's row gives p = 0.3 is credited 0.3 even when the
    draw happened to equal it (Rao-Blackwell: same mean, no 0/1 noise); greedy-style 0/1 scoring
    of the same draws would credit 1. The shadow still follows the emitted text."""
    t = _linear(10.0, 2.0)
    rows = [np.full(8, 0.1)]
    rows[0][5] = 0.3
    for probs, want in ((rows, 0.3), (None, 1.0)):
        sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, 0.0))
        rng = np.random.default_rng(0)
        for _ in range(60):
            sched.draft(_ScriptedDrafter(token=5), [1, 2, 3], K_MAX - 1, SamplingParams(0.7), rng)
            sched.emitted([5], probs)  # the draw equals the draft token every time
        model = sched.learned.acceptance  # the bucket of the current run: its decayed counts, prior left out
        assert abs(model.hits[0] / model.tries[0] - want) < 1e-9
        assert sched.learned.run > 0  # the emitted tokens matched: the run goes on either way



def _bandwidth_bound() -> tuple[list[float], Scheduler]:
    """T(k) = 10 + 0.5(k−1) (a laptop GPU's flat curve) and a drafter at 3 ms per token: at
    acceptance 0.9 it would win ~1.6×, so the scheduler tries it from the first cycle."""
    t = _linear(10.0, 0.5)
    return t, Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=3.0))


def test_a_costly_drafter_that_could_win_big_drafts_from_the_first_cycle():
    t, sched = _bandwidth_bound()
    assert sched.cost.speedup(0.9, COSTLY_GAMMA) > 1.5
    sched.new_generation(n_prompt=100)
    gammas = _simulate(sched, _ScriptedDrafter(token=0), t, 3.0, cycles=30)
    assert gammas[0] > 0 and all(g > 0 for g in gammas)  # no plain steps waiting for a probe budget
    assert sched.learned.judged == [sum(gammas), sum(gammas)]  # every verified position passed


def test_a_dear_drafter_whose_probes_keep_winning_keeps_being_tried():
    """A drafter at 0.6 of a step a token (the SmolLM2 Q4_1 draft model beside the F32 target on this
    CPU) wins only at acceptance ≳ 0.9, so a fresh pair (PRIOR 0.5) is tried once, then probed on the
    plain steps' budget. A probe that wins spends none of it: the next probe follows at once, until
    the belief says drafting pays (until f4c8fff..68cd688 each probe waited for a new budget)."""
    t = _linear(14.5, 1.95)  # T(8) ≈ 1.94·T(1), as cpu-epyc-f32
    sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=8.7,
                                catch_up_ms=0.0183))  # the KV handoff copy
    assert sched.cost.speedup(0.5, COSTLY_GAMMA) == 1.0 and sched.cost.speedup(0.98, COSTLY_GAMMA) > 1.15
    sched.new_generation(n_prompt=10)
    gammas = _simulate(sched, _ScriptedDrafter(token=0), t, 8.7, cycles=800)
    assert gammas[0] > 0  # tried at once
    probe = next(i for i, g in enumerate(gammas) if i > 0 and g > 0)  # the first probe on the budget
    assert all(g > 0 for g in gammas[probe:])  # then drafting every cycle
    assert sched.learned.mean() > 0.9


def test_a_costly_drafter_that_explores_and_misses_is_switched_off_within_a_few_cycles():
    t, sched = _bandwidth_bound()
    gammas = _simulate(sched, _ScriptedDrafter(token=7), t, 3.0, cycles=300)
    first_plain = next(i for i, g in enumerate(gammas) if g == 0)
    assert first_plain <= 3  # the optimistic prior is worth a few verified positions only
    assert sum(g > 0 for g in gammas) <= 3 + 5  # then probes on their small budget, as before
    assert sched.learned.judged[0] == 0 and sched.learned.judged[1] == sum(g > 0 for g in gammas)


def test_a_pair_known_to_miss_starts_plain_and_a_compute_bound_target_never_explores():
    t, _ = _bandwidth_bound()
    known_bad = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=3.0), prior=0.2)
    assert _simulate(known_bad, _ScriptedDrafter(token=0), t, 3.0, cycles=5)[0] == 0
    known_good = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=3.0), prior=0.95)
    assert _simulate(known_good, _ScriptedDrafter(token=0), t, 3.0, cycles=1)[0] >= 3
    q4 = _linear(10.0, 8.0)  # T(8) ≈ 6.6·T(1): even a perfect drafter at 6 ms per token cannot win
    compute_bound = Scheduler(CostModel({k: q4[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=6.0))
    assert compute_bound.cost.speedup(1.0, COSTLY_GAMMA) == 1.0  # γ = 0 is best
    assert compute_bound._probe(K_MAX - 1) == 0  # nothing to win: no probes
    assert _simulate(compute_bound, _ScriptedDrafter(token=0), q4, 6.0, cycles=20) == [0] * 20


def test_a_drafter_that_must_first_read_a_long_prompt_starts_only_if_the_reply_pays_for_it():
    t, sched = _bandwidth_bound()
    sched.cost.catch_up.add(1.0)  # 1 ms per prompt token the draft model has not read
    sched.new_generation(n_prompt=2000, max_tokens=64)  # 2 s of reading; 64 tokens save < 0.5 s
    assert _simulate(sched, _ScriptedDrafter(token=0), t, 3.0, cycles=10) == [0] * 10
    sched.new_generation(n_prompt=50, max_tokens=64)  # 50 ms of reading: it pays
    assert _simulate(sched, _ScriptedDrafter(token=0), t, 3.0, cycles=1)[0] > 0


def test_a_good_pair_that_hits_a_bad_stretch_comes_back():
    """A costly drafter right 95% of the time over many positions, then wrong for a stretch: the
    probe budget follows what the pair has shown it could win, so it is probed back within a few
    dozen plain steps, and the next text starts from the pair's long-run acceptance."""
    t, sched = _bandwidth_bound()
    sched.learned.judged = [950.0, 1000.0]
    gammas = _simulate(sched, _ScriptedDrafter(token=7), t, 3.0, cycles=20)  # a bad stretch
    assert gammas[0] > 0 and 0 in gammas
    back = _simulate(sched, _ScriptedDrafter(token=0), t, 3.0, cycles=150)  # the text turns predictable
    first = next(i for i, g in enumerate(back) if g > 0)
    assert first <= 60 and sum(g > 0 for g in back[first:]) >= 0.9 * (150 - first)
    sched.new_generation(n_prompt=10)
    assert sched.learned.acceptance.rates[0] > 0.9


def test_a_pair_record_outweighs_one_bad_start_but_not_a_lasting_one():
    """The record earlier engines kept (0.99) is worth STRENGTH positions, as the prior it replaces: a
    first text that misses 2 of 5 leaves the next text drafting; a pair that keeps missing here
    overrules the record within a few dozen positions."""
    from edgespec.schedule.acceptance import STRENGTH

    t, _ = _bandwidth_bound()
    sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=3.0), 0.99)
    sched.learned.judged = [3.0, 5.0]
    assert sched.learned.mean() == pytest.approx((3 + STRENGTH * 0.99) / (5 + STRENGTH))
    sched.new_generation(n_prompt=10)
    assert _simulate(sched, _ScriptedDrafter(token=0), t, 3.0, cycles=1)[0] > 0
    sched.learned.judged = [20.0, 200.0]  # right 10% of the time in this engine
    assert sched.learned.mean() < 0.2 and sched.cost.speedup(sched.learned.mean(), COSTLY_GAMMA) == 1.0


def test_a_weak_pair_keeps_the_small_probe_budget():
    t, sched = _bandwidth_bound()
    sched.learned.judged = [100.0, 1000.0]  # right 10% of the time: at that rate it could never win
    sched.new_generation(n_prompt=10)
    gammas = _simulate(sched, _ScriptedDrafter(token=7), t, 3.0, cycles=300)
    assert sum(g > 0 for g in gammas) <= 5


def test_a_flat_sampled_draft_is_not_cut_by_its_confidence_before_the_bin_is_seen():
    """Sampled: a draft token passes with Σ min(p, q), which is high for a close drafter however flat
    q is, so a bin never seen starts from the position's rate; greedy keeps confidence as the prior."""
    t = _linear(10.0, 0.5)
    drafter = _ScriptedDrafter(token=0, confidence=[0.3] * K_MAX)
    lengths = {}
    for params in (SamplingParams(0.7), GREEDY):
        sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=1.0))
        sched.learned.acceptance = Acceptance(prior=0.95)
        sched.learned.recent = 0.95
        d, _ = sched.draft(drafter, [1, 2, 3], K_MAX - 1, params, np.random.default_rng(0))
        lengths[params.greedy] = len(d.tokens)
    assert lengths == {False: 4, True: 2}  # sampled: the slow-start cap; greedy: cut by confidence 0.3


def test_catch_up_is_never_priced_above_a_drafted_token():
    cost = CostModel({1: 10.0, 2: 11.0}, draft_per_token_ms=4.0, draft_fixed_ms=2.0)
    assert cost.t_catch_up(100) == pytest.approx(100.0)  # the prior: a quarter of a drafted token
    cost.observe_draft(1, 6.0 + 30 * 12.0, synced=30)  # a fresh context's first read: set-up included
    assert cost.t_catch_up(100) == pytest.approx(400.0)  # capped at 4 ms a token
    measured = CostModel({1: 10.0, 2: 11.0}, draft_per_token_ms=4.0, draft_fixed_ms=2.0, catch_up_ms=2.5)
    assert measured.t_catch_up(100) == pytest.approx(250.0)  # the read cost measured at load, before any


def test_catch_up_is_the_cheaper_of_reading_what_was_missed_and_copying_the_targets_cache():
    cost = CostModel({1: 10.0, 2: 11.0}, draft_per_token_ms=4.0, catch_up_ms=2.5, copy_ms=0.01)
    assert cost.t_catch_up(1, context=400) == pytest.approx(2.5)  # one token: read, never copied
    assert cost.t_catch_up(2, context=400) == pytest.approx(4.0)  # copying 400 cells beats reading 2
    assert cost.t_catch_up(100, context=400) == pytest.approx(4.0)
    cost.observe_draft(2, cost.t_draft()[2] + 8.0, synced=300, copied=400)  # a copy, in a draft's noise:
    assert cost.catch_up.n == 0 and cost.draft_at[2].n == 0  # learned from neither as a read nor as a draft
    assert cost.t_catch_up(100, context=400) == pytest.approx(4.0)  # the copy cost timed at open stands
    no_copy = CostModel({1: 10.0, 2: 11.0}, draft_per_token_ms=4.0, catch_up_ms=2.5)
    assert no_copy.t_catch_up(100, context=400) == pytest.approx(250.0)


@pytest.mark.parametrize("copy_ms", [0.01, None])
def test_a_fresh_pair_is_tried_at_once_and_after_a_miss_probed_only_as_its_expected_gain_pays(copy_ms):
    """No record of the pair: it is tried at once. Its first draft misses, and at these costs (a draft
    token at 0.4 of a step) only an acceptance above ~0.88 would win: the belief after one miss
    (Beta(2, 3): PRIOR 0.5 worth STRENGTH 4 positions, and the miss) gives an expected gain under 1%,
    so it is not probed again for hundreds of plain steps, copy or not (probes may lose PROBE_SHARE ×
    that gain of the plain steps' time). The price: a pair this good whose first token missed is
    found late (docs/scheduler.md, known limits)."""
    t = [0.0, 25.0] + [28.0 + 2.7 * k for k in range(2, K_MAX + 1)]  # SmolLM2 F32's profile here
    cost = CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=10.0, draft_fixed_ms=6.0,
                     catch_up_ms=4.7, copy_ms=copy_ms)  # its Q4_1 copy, as timed in the loop
    sched = Scheduler(cost)
    sched.new_generation(n_prompt=1)
    before = sched.expected_gain()[0]
    assert _simulate(sched, _ScriptedDrafter(token=7), t, 10.0, cycles=1)[0] > 0  # tried at once, missed
    after = sched.expected_gain()[0]
    assert 0 < after < min(0.01, before / 2), (before, after)
    assert _simulate(sched, _ScriptedDrafter(token=0), t, 10.0, cycles=300) == [0] * 300


def test_a_drafter_timed_while_the_machine_was_slow_is_not_judged_dear_once_it_recovers():
    """Something else slowed the machine 2× while the drafter was timed: its drafts are kept in the
    target's profile units, so when plain steps show the machine back at speed (the drafter judged too
    dear would seldom be timed again) T_draft is back too."""
    t = {k: 10.0 + 0.5 * (k - 1) for k in range(1, K_MAX + 1)}
    cost = CostModel(t, draft_per_token_ms=3.0)
    for _ in range(10):  # slow: every forward takes twice its time
        cost.observe_verify(1, 2 * t[1])
        cost.observe_verify(5, 2 * t[5])
        cost.observe_draft(4, 2 * 12.0)
    assert cost.t_draft()[4] == pytest.approx(24.0, rel=0.05)
    for _ in range(20):  # back to speed, plain steps only
        cost.observe_verify(1, t[1])
    assert cost.t_draft()[4] == pytest.approx(12.0, rel=0.05)
    assert cost.t_catch_up(10) == pytest.approx(10 * 3.0 / 4, rel=0.05)  # the prior's quarter-token read


def test_a_pair_that_wins_only_when_almost_always_right_is_probed_at_what_it_has_shown():
    """In the loop the SmolLM2 F32 target's T(2) is 1.8·T(1) and its Q4_1 copy drafts at half a step:
    the pair wins only at long right runs, which no γ does at 0.9. A pair right 98% of the time over
    a thousand positions is probed at the acceptance it has if it wins (~0.98), comes back within a
    few dozen plain steps of a miss, and drafts on once its probes are right."""
    t = [0.0, 20.0] + [27.0 + 5.3 * k for k in range(2, K_MAX + 1)]
    sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=8.0, copy_ms=0.01))
    assert best_gamma(_const(0.9, 4), sched.cost.t_draft(), t)[0] == 0 and sched.cost.speedup(0.98, COSTLY_GAMMA) > 1.02
    sched.learned.judged = [980.0, 1000.0]
    sched.new_generation(n_prompt=10)
    assert _simulate(sched, _ScriptedDrafter(token=7), t, 8.0, cycles=1)[0] > 0  # drafts, misses
    back = _simulate(sched, _ScriptedDrafter(token=0), t, 8.0, cycles=100)
    first = next((i for i, g in enumerate(back) if g > 0), len(back))
    assert 0 < first <= 60 and all(g > 0 for g in back[-15:])


def test_a_copy_from_a_long_match_is_bet_on_at_once_after_a_miss():
    """A copying drafter's evidence is the match it copies from, not the run of right drafts, which a
    miss resets: a 16-token match right after a miss is verified long from the first draft (no slow
    start), a 2-token one is verified short (SLOW_START), at the same acceptance."""
    t = _linear(10.0, 0.5)
    gammas = {}
    for support in (16, 2):
        s = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}))
        s.learned.acceptance = Acceptance(prior=0.9, strength=1e9)
        s.learned.run, s.learned.recent = 0, 0.9
        d, _ = s.draft(_ScriptedDrafter(1, n=15, support=support), [0, 1, 2], K_MAX - 1, GREEDY,
                       np.random.default_rng(0))
        gammas[support] = len(d.tokens)
        assert s._support == support
    assert gammas[16] >= 10 and gammas[2] <= 4, gammas


def test_a_priced_drafter_is_never_free():
    """A feature head at ~1 ms a token beside an F32 target's 22 ms step costs under 5% of a step per
    token, but a free drafter drafts K_MAX − 1 tokens every cycle (31 ms): a drafter that prices
    itself, however cheap, is costly, and a weak one is not asked for a draft each plain step. A lookup
    (unpriced) is free."""
    t = _linear(22.0, 1.0)
    costs = {k: t[k] for k in range(1, K_MAX + 1)}
    head = Scheduler(CostModel(costs, draft_per_token_ms=1.0))
    assert not head.cost.free and not CostModel(costs, draft_per_token_ms=0.02).free  # 31 tokens: 0.6 ms
    assert CostModel(costs).free
    drafter = _ScriptedDrafter(token=1)  # never right
    gammas = _simulate(head, drafter, t, 1.0, cycles=60)
    # tried at once (no record), then while its belief still allows a win, drafted on a shrinking
    # budget: by cycle 17 it is off for good, not asked for 31 tokens every cycle (as a free drafter
    # it drafted in all 60)
    assert drafter.calls <= 20 and sum(gammas[-30:]) == 0, (drafter.calls, gammas)


@pytest.mark.parametrize("draft_ms", [0.0, 1.0])  # a free copier, a cheap costly drafter
def test_only_a_free_drafters_copies_are_verified_beyond_costly_gamma(draft_ms):
    """Verification is nearly free per token and every draft is right: a free drafter copying from a
    long match is verified up to K_MAX − 1 tokens at once; a costly one drafts at most COSTLY_GAMMA
    (its long draft's tail is a bet at the margin, where sampled and chained runs lost)."""

    t = _linear(10.0, 0.2)
    sched = Scheduler(CostModel({k: t[k] for k in range(1, K_MAX + 1)}, draft_ms))
    gammas = _simulate(sched, _ScriptedDrafter(token=0, support=16 if draft_ms == 0 else None), t, draft_ms,
                       cycles=40)
    assert max(gammas) == (K_MAX - 1 if draft_ms == 0 else COSTLY_GAMMA)


def test_survival_keeps_every_position_when_given_fewer_confidences_than_asked():
    """Confidences for the first positions only: those are calibrated, the rest keep the learned
    rates at their own positions (the list once shrank, shifting every later position)."""
    from edgespec.schedule.acceptance import Learned

    learned = Learned(0.5)
    rates = learned.survival(None, 0, sampled=False)
    short = learned.survival([0.9, 0.8], 4, sampled=False)
    assert len(short) == len(rates) == K_MAX
    assert short == learned.survival([0.9, 0.8], 2, sampled=False)
    assert short[2] / short[1] == pytest.approx(rates[2] / rates[1])  # position 3: its learned rate
