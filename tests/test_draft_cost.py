"""T_draft(γ) = fixed + γ·per_token: block drafters' optima, learning the line from noisy timings,
and the DFlash drafter's prior (timed on a fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from edgespec.drafters.base import DraftCost
from edgespec.schedule.costs import K_MAX, CostModel
from edgespec.schedule.scheduler import best_gamma


def _verify(t1: float, slope: float) -> dict[int, float]:
    return {k: t1 * (1 + slope * (k - 1)) for k in range(1, K_MAX + 1)}


def test_a_fixed_block_cost_moves_the_optimum_to_longer_drafts():
    # T(k) = 1 + 0.3(k−1), α = 0.8 per position:
    #   E[γ] = (1 − 0.8^{γ+1}) / 0.2 = 1, 1.8, 2.44, 2.952, 3.3616, 3.68928
    # block F = 0.5 = 0.5·T(1), no per-token part: cost(γ>0) = 1.5 + 0.3γ = 1.8, 2.1, 2.4, 2.7, 3.0
    #   rates 1.0 (γ=0), 1.0, 1.1619, 1.23, 1.24504, 1.22976: γ* = 4
    # the same 0.5 spent on 4 drafts as a chain (0.125 per token): cost 1 + 0.425γ = 1.425, 1.85, 2.275
    #   rates 1.2632, 1.3189, 1.2976: γ* = 2
    alpha = np.cumprod([0.8] * (K_MAX - 1)).tolist()
    block = CostModel(_verify(1.0, 0.3), draft_per_token_ms=0.0, draft_fixed_ms=0.5, block=True)
    assert block.t_draft()[:3] == [0.0, 0.5, 0.5]
    g, rate = best_gamma(alpha, block.t_draft(), block.t_verify())
    assert g == 4 and rate == pytest.approx(3.3616 / 2.7)
    chain = CostModel(_verify(1.0, 0.3), draft_per_token_ms=0.125)
    assert best_gamma(alpha, chain.t_draft(), chain.t_verify())[0] == 2


def test_learning_converges_to_the_fixed_and_per_token_parts_from_noisy_timings():
    # truth: 8 ms + 0.5 ms per row, 5% noise and one sample in 10 four times too slow (a hiccup);
    # the prior is badly wrong (a chain of 4 ms per token)
    cost = CostModel(_verify(20.0, 0.1), draft_per_token_ms=4.0, block=True)
    rng = np.random.default_rng(0)
    for i in range(400):
        g = 1 + i % 8
        ms = (8.0 + 0.5 * g) * (1 + 0.05 * rng.standard_normal()) * (4.0 if i % 10 == 3 else 1.0)
        cost.observe_draft(g, ms)
    fixed, per_token = cost.draft_fit()
    assert fixed == pytest.approx(8.0, abs=0.4) and per_token == pytest.approx(0.5, abs=0.08)
    assert cost.t_draft()[4] == pytest.approx(fixed + 4 * per_token)


def test_one_draft_length_scales_the_prior():
    # prior 10 + 1·γ; γ = 4 measured at 28 ms (the prior's 14, doubled): 20 + 2γ everywhere, once the
    # timings have outweighed the prior they start from (each moves the estimate 30% of the way)
    cost = CostModel(_verify(20.0, 0.1), draft_per_token_ms=1.0, draft_fixed_ms=10.0, block=True)
    cost.observe_draft(4, 28.0)
    assert cost.draft_fit() == pytest.approx((10.0 * 18.2 / 14, 18.2 / 14))  # 14 + 0.3·(28 − 14)
    for _ in range(30):
        cost.observe_draft(4, 28.0)
    assert cost.draft_fit() == pytest.approx((20.0, 2.0), rel=1e-3)
    assert cost.t_draft()[1] == pytest.approx(22.0, rel=1e-3) and cost.t_draft()[8] == pytest.approx(36.0, rel=1e-3)


def test_a_slow_first_draft_does_not_replace_a_measured_prior():
    # a draft model timed at 20 ms a token; its first draft after a prompt pays a one-off set-up (45 ms):
    # the estimate moves towards it, and back as soon as drafts cost what the prior said
    cost = CostModel(_verify(40.0, 0.1), draft_per_token_ms=20.0, draft_fixed_ms=5.0)
    cost.observe_draft(1, 45.0)
    assert cost.t_draft()[1] == pytest.approx(25.0 + 0.3 * 20.0)
    for _ in range(10):
        cost.observe_draft(1, 25.0)
    assert cost.t_draft()[1] == pytest.approx(25.0, abs=0.5)


def test_the_fit_never_goes_negative():
    flat = CostModel(_verify(20.0, 0.1), block=True)
    flat.observe_draft(2, 10.2)
    flat.observe_draft(6, 9.8)  # slope −0.1 is noise: the mean, flat
    assert flat.draft_fit() == pytest.approx((10.0, 0.0))
    chain = CostModel(_verify(20.0, 0.1))
    chain.observe_draft(1, 1.0)
    chain.observe_draft(3, 3.2)  # line 1.1γ − 0.1: through 0 instead, Σγt / Σγ² = (1 + 9.6) / (1 + 9)
    assert chain.draft_fit() == pytest.approx((0.0, 1.06))


class _FakeBlockHead:
    """A DFlash head whose block of n tokens costs 5 + 0.25·n ms on a fake clock."""

    block_size, n_past = 16, 0

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock

    def block_tokens(self, anchor: int, n: int) -> list[int]:
        return [anchor] * n

    def block_logits(self, tokens):
        self.clock[0] += (5.0 + 0.25 * len(tokens)) / 1000
        return np.zeros((len(tokens), 3), np.float32)

    def truncate(self, n_past: int) -> None:
        pass


def test_dflash_prior_is_a_fixed_block_cost(monkeypatch):
    from edgespec.drafters import dflash

    clock = [0.0]
    monkeypatch.setattr(dflash.time, "perf_counter", lambda: clock[0])
    drafter = dflash.DFlashDrafter(_FakeBlockHead(clock), target=SimpleNamespace(n_ctx=4096))
    # blocks of 1 + 1 and 15 + 1 tokens: 5.5 and 9 ms → 0.25 ms per row, 5.5 − 0.25 = 5.25 fixed
    assert drafter.cost_prior() == DraftCost(pytest.approx(5.25), pytest.approx(0.25), block=True)
    assert drafter.measure_ms_per_token() == pytest.approx((5.0 + 0.25 * 5) / 4)  # the old prior


def test_chain_drafters_prior_is_per_token(monkeypatch):
    from edgespec.drafters.eagle import EagleDrafter
    from edgespec.drafters.ngram import NgramDrafter

    monkeypatch.setattr(EagleDrafter, "measure_ms_per_token", lambda self: 3.0)
    assert EagleDrafter(head=None, target=None).cost_prior() == DraftCost(0.0, 3.0, block=False)
    assert NgramDrafter().cost_prior() is None  # an n-gram drafter: free
