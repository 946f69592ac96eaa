"""The sampling losslessness test of test_lossless_reference.py with MLX models in the loop: a tiny
mlx-lm llama (6-token vocabulary, built by a fixture) as target and a perturbed copy as drafter,
both on the MLX backend. Each generated position's distribution over many speculative generations
is within TV 0.01 of the exact distribution, enumerated from the same MLX model."""

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
DRAWS = 50_000  # expected TV of the empirical marginals ≈ 0.9/√DRAWS = 0.004: the 0.01 bound is ≈ 6σ away


class _Oracle:
    """next_logits(context) from a fresh evaluation of the whole context: what _exact_marginals needs."""

    def __init__(self, backend: MlxBackend) -> None:
        self.b, self.n_vocab = backend, backend.n_vocab

    def next_logits(self, context):
        self.b.truncate(0)
        return self.b.eval(context, rows="last")[0]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlx-tv")
    target = build_tiny_mlx(root / "target", n_vocab=V, seed=3)
    drafter = build_tiny_mlx(root / "drafter", n_vocab=V, seed=4, base_seed=3, perturb=0.2)
    return target, drafter


def _open(path) -> MlxBackend:
    return MlxBackend(path, vocab=ReferenceBackend(V), n_ctx=64)


@pytest.mark.slow
def test_sampled_spec_on_mlx_matches_the_target_distribution(pair):
    target_dir, drafter_dir = pair
    params = SamplingParams(temperature=0.8, top_p=0.95)
    prompt, n_pos = [0, 1, 2, 0, 1, 2, 0, 1], 4
    exact, _ = _exact_marginals(_Oracle(_open(target_dir)), prompt, params, n_pos)
    engine = Engine(_open(target_dir), DraftModelDrafter(_open(drafter_dir), V), num_draft=3)
    spec, _ = _empirical(engine, prompt, params, n_pos, DRAWS)
    for pos in range(n_pos):
        assert 0.5 * np.abs(spec[pos] - exact[pos]).sum() <= 0.01, (pos, spec[pos], exact[pos])
    s = engine.generate(prompt, max_tokens=32, temperature=0.8, top_p=0.95, seed=0).stats
    assert 0 < s.n_accepted < s.n_drafted  # drafts were both accepted and rejected


def test_mlx_draft_pair_is_a_real_test(pair):
    """The fixture pair is neither identical nor unrelated: some drafts are accepted, some rejected,
    and the exact marginals are not degenerate (fast; the slow test above relies on this)."""
    target_dir, drafter_dir = pair
    params = SamplingParams(temperature=0.8, top_p=0.95)
    exact, _ = _exact_marginals(_Oracle(_open(target_dir)), [0, 1, 2], params, 2)
    assert (exact.max(axis=1) < 0.9).all() and (np.count_nonzero(exact > 0.02, axis=1) >= 2).all()
    engine = Engine(_open(target_dir), DraftModelDrafter(_open(drafter_dir), V), num_draft=3)
    drafted = accepted = 0
    for seed in range(20):
        s = engine.generate([0, 1, 2], max_tokens=16, temperature=0.8, top_p=0.95, seed=seed).stats
        drafted, accepted = drafted + s.n_drafted, accepted + s.n_accepted
    assert 0.2 * drafted < accepted < 0.95 * drafted
