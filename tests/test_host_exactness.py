"""The fast host path (process_rows, Dist, sample_weights, verify) against the code it replaced.

The oracle is host_oracle.py, the row-at-a-time implementation kept unchanged: same kept set on
every row, kept probabilities within 1e-12 (relative), and an unrestricted float32 softmax within
the bound process_rows states, 2⁻²³·(21 + |z|) relative. Rows: LM-like synthetic ones of 49k–262k
ids here; recorded rows of every fetched model in the `real` test.
"""

from __future__ import annotations

from pathlib import Path

import host_oracle as old
import numpy as np
import pytest

from edgespec.sampling import SamplingParams, process, process_rows, sample_weights
from edgespec.verify import verify_stochastic

PARAMS = [SamplingParams(0.7), SamplingParams(0.7, top_p=0.95), SamplingParams(0.7, top_k=40, top_p=0.95),
          SamplingParams(0.7, min_p=0.05), SamplingParams(1.0, top_k=40), SamplingParams(0.7, top_p=0.5, min_p=0.02),
          SamplingParams(1.3, top_p=0.99), SamplingParams()]


PROMPT = ("The committee met on Tuesday to discuss the budget. After a long debate about the new library, "
          "the members agreed that the town should")


def recorded_rows(path: Path, n: int) -> np.ndarray:
    """(n, V) float32 logits the model gives after the first tokens of PROMPT (llama.cpp backend)."""
    from edgespec.drafters.registry import open_backend

    with open_backend(str(path), n_ctx=256, threads=1) as b:
        ids = b.tokenize(PROMPT)[: n + 4]
        return np.ascontiguousarray(b.eval(ids, rows="all")[-n:], dtype=np.float32)


def lm_rows(n_vocab: int, n: int, seed: int) -> np.ndarray:
    """Peaked rows (a dozen tokens above a normal bulk), some flat ones, float32 like a backend's."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, rng.uniform(0.5, 3.0, (n, 1)), (n, n_vocab)).astype(np.float32)
    for r in range(0, n, 2):
        head = rng.choice(n_vocab, 12, replace=False)
        x[r, head] = x[r].max() + rng.uniform(0.0, 8.0, 12)
    return x


def assert_same(x: np.ndarray, params: SamplingParams) -> None:
    """process_rows equals the oracle on every row of x: same kept set, probabilities within bound."""
    for r, dist in enumerate(process_rows(x, params)):
        want, got = old.process(x[r], params), dist.dense()
        assert np.array_equal(want > 0, got > 0) or dist.ids is None, (r, params)
        restricted = params.greedy or dist.ids is not None
        if restricted:
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
        else:  # the unrestricted float32 softmax: the stated bound, 2^-23 (21 + |z|)
            z = (x[r].astype(np.float64) - x[r].max()) / params.temperature
            bound = 2.0 ** -23 * (21 + np.abs(z)) * want + 1e-37
            assert np.all(np.abs(got - want) <= bound), (r, params)
        assert got.sum() == pytest.approx(1.0, abs=1e-9 if restricted else 4e-6)
        assert process(x[r], params).tolist() == got.tolist()


@pytest.mark.parametrize("n_vocab", [49152, 152064, 262144])
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_process_rows_equals_the_old_process(n_vocab, params):
    assert_same(lm_rows(n_vocab, 6, seed=n_vocab % 97), params)


@pytest.mark.parametrize("n_vocab", [20, 33, 1005])
def test_vocabularies_that_are_no_multiple_of_the_block(n_vocab):
    """Ids past the last whole block (and rows shorter than one block) are candidates too."""
    x = lm_rows(n_vocab, 6, seed=n_vocab)
    x[1, -1] = x[1].max() + 5.0  # the top token among the ids past the blocks
    for params in PARAMS:
        assert_same(x, params)


def test_float64_rows_are_processed_in_float64():
    x = lm_rows(5000, 4, seed=1).astype(np.float64)
    for params in PARAMS:
        for r, dist in enumerate(process_rows(x, params)):
            np.testing.assert_allclose(dist.dense(), old.process(x[r], params), rtol=1e-13, atol=1e-300)


def test_an_undecided_nucleus_falls_back_to_the_whole_vocabulary():
    """A flat row puts most of the mass below the candidates: the bound cannot decide, the whole
    vocabulary does, and the kept set is still the oracle's."""
    x = np.random.default_rng(3).normal(0, 0.3, (2, 152064)).astype(np.float32)
    assert_same(x, SamplingParams(0.7, top_p=0.95))
    x[:, :5] += 30.0  # and a row whose tail lies entirely below the candidates (top-k alone)
    assert_same(x, SamplingParams(0.7, top_k=40))


def test_dist_indexing_and_exclusion():
    x = lm_rows(49152, 2, seed=4)
    for params in PARAMS[:4]:
        dist, dense = process_rows(x[:1], params)[0], old.process(x[0], params)
        for t in np.flatnonzero(dense)[:20]:
            assert dist[int(t)] == pytest.approx(dense[t], rel=1e-5)
        top = int(np.argmax(dense))
        rng = np.random.default_rng(0)
        assert all(dist.sample(rng, exclude=top) != top for _ in range(200))


def test_sample_weights_draws_the_weights():
    """Block sampling (block sums, then inside the block) has the weights' distribution (TV ≤ 0.02)."""
    rng = np.random.default_rng(5)
    w = np.zeros(20000, np.float32)
    w[[3, 4095, 4096, 9000, 19999]] = [0.1, 0.2, 0.3, 0.15, 0.25]
    draws = np.bincount([sample_weights(w, rng) for _ in range(20000)], minlength=w.shape[0])
    assert set(np.flatnonzero(draws)) <= {3, 4095, 4096, 9000, 19999}
    assert 0.5 * np.abs(draws / draws.sum() - w / w.sum()).sum() < 0.02


@pytest.mark.parametrize("one_hot", [True, False])
def test_verify_emits_what_the_old_verify_emits(one_hot):
    """Emitted first tokens of verify and the oracle's verify agree in distribution (both sampled
    10⁴ times on rows of 3000 ids with small nuclei; TV ≤ 0.03)."""
    params = SamplingParams(0.8, top_p=0.9)
    x = lm_rows(3000, 3, seed=6)
    q = np.stack([old.process(r, params) for r in lm_rows(3000, 2, seed=7)])
    draft = [int(np.argmax(x[0])), int(np.argmax(x[1]))]
    counts = []
    for fn in (verify_stochastic, old.verify_stochastic):
        rng = np.random.default_rng(8)
        n = 10_000
        first = [fn(x, draft, None if one_hot else q, params, rng) for _ in range(n)]
        counts.append(np.bincount([draft[0] if a > 0 else t for a, t in first], minlength=3000) / n)
    assert 0.5 * np.abs(counts[0] - counts[1]).sum() < 0.03


@pytest.mark.real
def test_recorded_rows_of_every_fetched_model(smollm2_path, gemma_q4_path, gemma_q8_path, gemma_f16_path):
    """Recorded logits of every fetched model: the new process equals the old on each parameter set."""
    for path in (smollm2_path, gemma_q4_path, gemma_q8_path, gemma_f16_path):
        x = recorded_rows(path, n=9)
        for params in PARAMS:
            assert_same(x, params)
