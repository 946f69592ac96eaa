"""Pure-function tests of sampling and verification (exact where the maths allows)."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.sampling import InvalidSamplingError, SamplingParams, process, sample
from edgespec.verify import verify, verify_greedy, verify_stochastic


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-1), dict(min_p=1.0), dict(temperature=float("nan"))])
def test_invalid_params_raise_one_line(kwargs):
    with pytest.raises(InvalidSamplingError) as e:
        SamplingParams(**{"temperature": 0.8, **kwargs})
    assert "\n" not in str(e.value) and str(next(iter(kwargs))) in str(e.value)


def test_process_matches_hand_computation():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = process(logits, SamplingParams(temperature=1.0, top_p=0.8))  # nucleus {0,1,2}: 0.85 ≥ 0.8
    np.testing.assert_allclose(p, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])
    p = process(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [5 / 7, 2 / 7, 0, 0, 0])
    p = process(logits, SamplingParams(temperature=1.0, min_p=0.3))  # keeps p >= 0.15
    np.testing.assert_allclose(p, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])
    p = process(logits, SamplingParams(temperature=0.5))  # p^2 renormalised
    sq = np.array([0.5, 0.2, 0.15, 0.1, 0.05]) ** 2
    np.testing.assert_allclose(p, sq / sq.sum())
    assert process(logits, SamplingParams()).tolist() == [1, 0, 0, 0, 0]


@pytest.mark.parametrize("n_vocab, scale, temperature", [
    (20000, 0.5, 0.9), (20000, 3.0, 0.9), (20000, 8.0, 0.9),  # flat (full sort) to peaked (probe of 512)
    (262144, 3.0, 0.7), (262144, 2.0, 0.7),  # Gemma-sized: nuclei of ~700 and ~15000 (probes of 8192, 131072)
])
def test_top_p_probe_is_exact_on_large_vocab(n_vocab, scale, temperature):
    logits = np.random.default_rng(0).normal(0, scale, n_vocab)
    p = process(logits, SamplingParams(temperature=temperature, top_p=0.9))
    z = np.exp((logits - logits.max()) / temperature)
    z /= z.sum()
    order = np.argsort(-z, kind="stable")
    n = int(np.searchsorted(np.cumsum(z[order]), 0.9)) + 1
    ref = np.zeros_like(z)
    ref[order[:n]] = z[order[:n]]
    np.testing.assert_allclose(p, ref / ref.sum(), rtol=1e-12, atol=1e-15)


def test_sample_never_draws_zero_probability():
    rng = np.random.default_rng(1)
    p = np.array([0.0, 0.3, 0.0, 0.7, 0.0])
    draws = np.array([sample(p, rng) for _ in range(20000)])
    assert set(draws.tolist()) == {1, 3}
    assert abs((draws == 3).mean() - 0.7) < 0.02


def test_verify_greedy():
    logits = np.eye(4)[[1, 2, 3, 0]]  # argmax rows: 1, 2, 3, 0
    assert verify_greedy(logits, [1, 2, 3]) == (3, 0)  # all accepted + bonus
    assert verify_greedy(logits, [1, 0, 3]) == (1, 2)  # correction at the first mismatch
    assert verify_greedy(logits[:1], []) == (0, 1)  # plain step


@pytest.mark.parametrize("one_hot", [False, True])
def test_single_position_verification_is_exactly_p(one_hot):
    """One draft position: the emitted token's distribution equals p (10⁵ draws, TV ≤ 0.01)."""
    rng = np.random.default_rng(2)
    V, N = 6, 100_000
    params = SamplingParams(temperature=0.8, top_p=0.95)
    logits = rng.normal(0, 1.5, (2, V))
    p = process(logits[0], params)
    q = process(rng.normal(0, 1.5, V), params)
    counts = np.zeros(V)
    for _ in range(N):
        x = int(np.argmax(q)) if one_hot else sample(q, rng)
        n, tok = verify_stochastic(logits, [x], None if one_hot else q[None], params, rng)
        counts[x if n == 1 else tok] += 1
    tv = 0.5 * np.abs(counts / N - p).sum()
    assert tv <= 0.01, tv


def test_verify_stochastic_hands_back_one_row_per_emitted_token():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((4, 16)).astype(np.float32)
    for _ in range(20):
        rows: list[np.ndarray] = []
        n, _ = verify(logits, [3, 4, 5], None, SamplingParams(0.9), rng, rows)
        assert len(rows) == n + 1 and all(abs(r.dense().sum() - 1) < 1e-5 for r in rows)  # float32 softmax
    rows = []
    verify(logits, [3], None, SamplingParams(), rng, rows)
    assert rows == []
