"""The sampling losslessness test of test_lossless_reference.py with an MLX target in the loop: a tiny
mlx-lm llama (6-token vocabulary, one layer, built by a fixture) on the MLX backend, drafted for by a numpy
reference model with the same vocabulary. Each generated position's distribution over many
speculative generations is within TV 0.01 of the exact distribution, enumerated from the MLX model.

The drafter is numpy because the MLX code the sampled path adds is the target's: verification rows
and the KV trim after a rejection at a random position. A draft model's q is `process` of its
logits on any backend, and the accept rule is exact for any q the draft was drawn from, so an MLX
drafter would only cost MLX forwards (three quarters of them). The MLX draft model's KV sync is
checked by the greedy pair test (test_mlx_gguf.py), the backend's rollback by test_mlx_backend.py."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_fixtures import build_tiny_mlx
from test_lossless_reference import _empirical, _exact_marginals

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

from edgespec.backends.mlx import MlxBackend  # noqa: E402
from edgespec.backends.reference import ReferenceBackend  # noqa: E402
from edgespec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from edgespec.engine import Engine  # noqa: E402
from edgespec.sampling import SamplingParams  # noqa: E402

V = 6
DRAWS = 50_000  # expected TV of the empirical marginals ≈ 0.0033 (sd 0.0013): the 0.01 bound is ≈ 5σ away
# One layer halves the MLX ops per forward. The test's power depends only on the target's marginals
# and DRAWS: simulated, this target (seed 2) fails a correct sampler less often (≤ 4e-5 per position)
# and catches a TV 0.011 / 0.0125 / 0.015 error more often (0.89 / 0.976 / 0.9994) than the
# two-layer seed-3 target did (6e-5; 0.88 / 0.972 / 0.9991).
TARGET_SEED, LAYERS = 2, 1
DRAFTER_SEED = 1  # cycle 1 accepts 0/1/2/3 of its 3 drafts in 36/45/10/9% of the draws


class _Oracle:
    """next_logits(context) from a fresh evaluation of the whole context: what _exact_marginals needs."""

    def __init__(self, backend: MlxBackend) -> None:
        self.b, self.n_vocab = backend, backend.n_vocab

    def next_logits(self, context):
        self.b.truncate(0)
        return self.b.eval(context, rows="last")[0]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_mlx(tmp_path_factory.mktemp("mlx-tv") / "target", n_vocab=V, seed=TARGET_SEED,
                          n_layers=LAYERS)


def _open(path) -> MlxBackend:
    return MlxBackend(path, vocab=ReferenceBackend(V), n_ctx=64)


def _engine(target_dir) -> Engine:
    return Engine(_open(target_dir), DraftModelDrafter(ReferenceBackend(V, seed=DRAFTER_SEED), V), num_draft=3)


@pytest.mark.slow
def test_sampled_spec_on_mlx_matches_the_target_distribution(target_dir):
    params = SamplingParams(temperature=0.8, top_p=0.95)
    prompt, n_pos = [0, 1, 2, 0, 1, 2, 0, 1], 4
    exact, _ = _exact_marginals(_Oracle(_open(target_dir)), prompt, params, n_pos)
    engine = _engine(target_dir)
    assert engine.target.name == "mlx"
    spec, _ = _empirical(engine, prompt, params, n_pos, DRAWS)
    for pos in range(n_pos):
        assert 0.5 * np.abs(spec[pos] - exact[pos]).sum() <= 0.01, (pos, spec[pos], exact[pos])
    s = engine.generate(prompt, max_tokens=32, temperature=0.8, top_p=0.95, seed=0).stats
    assert 0 < s.n_accepted < s.n_drafted  # drafts were both accepted and rejected


def test_mlx_draft_pair_is_a_real_test(target_dir):
    """The target and drafter are neither identical nor unrelated: some drafts are accepted, some
    rejected, and the exact marginals are not degenerate (fast; the slow test above relies on this)."""
    params = SamplingParams(temperature=0.8, top_p=0.95)
    exact, _ = _exact_marginals(_Oracle(_open(target_dir)), [0, 1, 2], params, 2)
    assert (exact.max(axis=1) < 0.9).all() and (np.count_nonzero(exact > 0.02, axis=1) >= 2).all()
    engine = _engine(target_dir)
    drafted = accepted = 0
    for seed in range(20):
        s = engine.generate([0, 1, 2], max_tokens=16, temperature=0.8, top_p=0.95, seed=seed).stats
        drafted, accepted = drafted + s.n_drafted, accepted + s.n_accepted
    assert 0.2 * drafted < accepted < 0.95 * drafted
