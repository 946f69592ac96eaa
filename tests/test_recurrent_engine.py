"""Recurrent targets in the engine, on the numpy reference backend with `recurrent=True`: its
`truncate` goes back only to the last checkpoint and re-evaluates from there, as a Mamba or
short-convolution state does on llama.cpp and MLX (tests/test_recurrent_llama.py, test_recurrent_mlx.py).

Greedy speculative output equals plain output with partial and full acceptances; sampled output
keeps the target's distribution; the scheduler prices a rollback (restore + re-evaluation)."""

from __future__ import annotations

import numpy as np
import pytest
from test_lossless_reference import PROMPTS, _empirical, _exact_marginals

from edgespec.backends.reference import ReferenceBackend
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.errors import BackendError
from edgespec.sampling import SamplingParams
from edgespec.schedule.costs import K_MAX, CostModel
from edgespec.schedule.scheduler import best_gamma, expected_rollback


def test_a_recurrent_reference_rolls_back_only_through_its_checkpoint():
    plain, rec = ReferenceBackend(6, seed=2), ReferenceBackend(6, seed=2, recurrent=True)
    tokens = [1, 2, 3, 4, 5, 0, 1, 2]
    rec.eval(tokens[:3], rows="none")
    with pytest.raises(BackendError, match="cannot roll a recurrent state back from 3 to 2 tokens"):
        rec.truncate(2)
    rec.checkpoint()
    rec.eval(tokens[3:], rows="none")
    for n in (6, 4, 3, 7):  # repeated rollbacks to positions at or after the checkpoint
        rec.truncate(n)
        assert rec.n_past == n
        rec.eval(tokens[n:], rows="none")
    assert rec.n_replayed == 3 + 1 + 0 + 4
    with pytest.raises(BackendError, match="checkpoint at or before 2 and the last one is at 3"):
        rec.truncate(2)
    rec.truncate(0)  # always possible
    assert rec.n_past == 0
    plain.eval(tokens, rows="none")
    rec.eval(tokens, rows="none")
    np.testing.assert_array_equal(rec.eval([3], rows="last"), plain.eval([3], rows="last"))


@pytest.fixture
def fixed_costs(monkeypatch):
    """-k auto with known costs (T(k) = 1 + 0.1(k−1) ms, drafts 0.05 ms, a rollback 0.1 ms) instead
    of numpy's microseconds, so that the scheduler speculates. (Priced as re-evaluating n + 1
    tokens, about T(1), rollbacks make the scheduler's 50% acceptance prior lose: plain steps.)"""
    from edgespec import calibration

    monkeypatch.setattr(CostModel, "t_rollback", lambda self, context=None: [0.1] * K_MAX)

    monkeypatch.setattr(calibration, "calibrate", lambda backend, ks=calibration.CALIBRATION_KS, **kw: {
        k: 0.05 if tuple(ks) != calibration.CALIBRATION_KS else 1 + 0.1 * (k - 1) for k in ks})  # a drafter: 0.05
    monkeypatch.setattr(calibration, "context_cost", lambda backend, **kw: 0.0)
    monkeypatch.setattr(CostModel, "observe_verify", lambda self, *args: None)
    monkeypatch.setattr(CostModel, "observe_draft", lambda self, *args: None)


def _drafters(target: ReferenceBackend, kind: str):
    return NgramDrafter() if kind == "ngram" else DraftModelDrafter(target.perturbed(0.8), target.n_vocab)


@pytest.mark.parametrize("gamma", [3, "auto"])
@pytest.mark.parametrize("kind", ["ngram", "draft-model"])
def test_greedy_spec_equals_plain_on_a_recurrent_target(kind, gamma, request):
    if gamma == "auto":
        request.getfixturevalue("fixed_costs")
    target = ReferenceBackend(6, seed=5, recurrent=True)
    drafter = _drafters(target, kind)
    engine = Engine(target, drafter, num_draft=gamma)
    rejected = partial = full = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_tokens=64, speculative=False)
        spec = engine.generate(prompt, max_tokens=64)
        assert spec.tokens == plain.tokens, prompt
        rejected += sum(n < d for d, n in spec.stats.cycles)  # each one a rollback
        partial += sum(0 < n < d for d, n in spec.stats.cycles)
        full += sum(d > 0 and n == d for d, n in spec.stats.cycles)
        assert spec.stats.n_rollbacks == sum(n < d for d, n in spec.stats.cycles)
    assert full > 0
    if gamma != "auto" or kind == "draft-model":  # -k auto bets on an n-gram loop only where it holds
        assert rejected > 0 and target.n_replayed > 0
    if kind == "draft-model":  # a greedy n-gram copy here is all or nothing; a draft model is not
        assert partial > 0
        assert drafter.model.recurrent and drafter.model.n_replayed > 0  # it rolled back too


def test_a_new_prompt_on_a_recurrent_target_reuses_what_it_can():
    target = ReferenceBackend(6, seed=5, recurrent=True)
    engine = Engine(target, NgramDrafter(), num_draft=3)
    first = engine.generate("abcabcab", max_tokens=24)
    # the follow-up extends the first exchange: kept from the checkpoint on, or evaluated again
    follow = "abcabcab" + first.text + "cab"
    again = engine.generate(follow, max_tokens=24)
    fresh = Engine(ReferenceBackend(6, seed=5), NgramDrafter(), num_draft=3).generate(follow, max_tokens=24)
    assert again.tokens == fresh.tokens
    assert again.stats.n_prompt_evaluated < len(follow)  # the cached prefix was reused
    other = engine.generate("fedcba", max_tokens=8)  # nothing in common: starts over
    assert other.tokens == Engine(ReferenceBackend(6, seed=5)).generate("fedcba", max_tokens=8).tokens


def test_calibration_runs_on_a_recurrent_target():
    from edgespec import calibration

    target = ReferenceBackend(6, seed=1, n_ctx=1024, recurrent=True)
    assert calibration.exact_batch(target) == 16
    t = calibration.time_forward(target, (1, 4), repeats=2)
    assert set(t) == {1, 4} and all(v > 0 for v in t.values())
    assert calibration.context_cost(target, refresh=True) >= 0.0
    assert target.n_past == 0


def test_the_scheduler_prices_rollbacks():
    survival = [0.6, 0.36, 0.22, 0.13]
    t_draft = [0.0] + [0.05] * 15
    t_verify = [0.0] + [1 + 0.1 * (k - 1) for k in range(1, 17)]
    rollback = [0.5 + t_verify[n + 1] for n in range(16)]
    # E[rollback | γ=2] = P(N=0)·r0 + P(N=1)·r1
    assert expected_rollback(survival, 2, rollback) == pytest.approx(0.4 * rollback[0] + 0.24 * rollback[1])
    assert expected_rollback(survival, 0, rollback) == 0.0
    free, _ = best_gamma(survival, t_draft, t_verify)
    priced, _ = best_gamma(survival, t_draft, t_verify, rollback)
    assert priced < free  # re-evaluating after a rejection makes long drafts dearer
    # the cost model learns the restore part from timed rollbacks
    cost = CostModel({1: 1.0, 16: 2.5}, recurrent=True)
    assert cost.t_rollback()[2] == pytest.approx(cost.t_verify()[3])
    for _ in range(5):
        cost.observe_rollback(2, cost.t_verify()[3] + 0.7)
    assert cost.t_rollback()[2] == pytest.approx(cost.t_verify()[3] + 0.7)
    assert CostModel({1: 1.0}).t_rollback() is None


@pytest.mark.slow
def test_sampled_spec_on_a_recurrent_target_matches_the_target_distribution():
    target = ReferenceBackend(6, seed=3, recurrent=True)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    prompt = target.tokenize("abcabcab")
    n_pos, draws = 4, 100_000
    exact, _ = _exact_marginals(target, prompt, params, n_pos)
    engine = Engine(target, DraftModelDrafter(target.perturbed(0.8), target.n_vocab), num_draft=3)
    spec, _ = _empirical(engine, prompt, params, n_pos, draws)
    for pos in range(n_pos):
        assert 0.5 * np.abs(spec[pos] - exact[pos]).sum() <= 0.01, (pos, spec[pos], exact[pos])
    assert target.n_replayed > 0  # rollbacks re-evaluated accepted tokens


def test_a_target_that_resets_itself_after_an_error_leaves_the_engine_consistent():
    """llama.cpp's recurrent backend drops its whole state when a restore fails (it cannot keep part
    of it): the engine must then forget its cached tokens too, or the next prompt would reuse them."""
    target = ReferenceBackend(6, seed=5, recurrent=True)
    engine = Engine(target, NgramDrafter(), num_draft=3)
    engine.generate("abcabcab", max_tokens=16)
    real_truncate, calls = target.truncate, []

    def failing_truncate(n):
        calls.append(n)
        if len(calls) == 2:  # the first rollback of the next generation fails and resets
            real_truncate(0)
            raise BackendError("restore failed (reset to 0 tokens)")
        real_truncate(n)

    target.truncate = failing_truncate
    prompt = "abcabcab" + "cafe" * 3
    with pytest.raises(BackendError, match="restore failed"):  # in the first cycle's rollback
        engine.generate(prompt, max_tokens=32)
    target.truncate = real_truncate
    assert target.n_past == 0
    again = engine.generate(prompt, max_tokens=16)  # the same prompt: its prefix was "cached" before
    assert again.stats.n_prompt_evaluated == len(prompt)  # nothing taken from a cache that is gone
    assert again.tokens == Engine(ReferenceBackend(6, seed=5)).generate(prompt, max_tokens=16).tokens
