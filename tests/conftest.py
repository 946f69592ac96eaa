"""Shared fixtures: the fetched real models (fail loudly when missing) and tiny GGUFs built from them."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_fixtures import build_tiny_llama

from edgespec.errors import ModelLoadError
from edgespec.models import resolve_model


def _fetched(name: str) -> Path:
    try:
        return resolve_model(name)
    except ModelLoadError as err:
        pytest.fail(f"{err} (this test needs the real models)", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (fetched)."""
    return _fetched("smollm2")


@pytest.fixture(scope="session")
def gemma_q4_path() -> Path:
    """Gemma-3-270M base, Q4_K_M release (fetched)."""
    return _fetched("gemma3")


@pytest.fixture(scope="session")
def gemma_q8_path() -> Path:
    """Gemma-3-270M Q8_0 derived from the Q4_K_M release."""
    return _fetched("gemma3-q8_0")


@pytest.fixture(scope="session")
def gemma_f16_path() -> Path:
    """Gemma-3-270M F16 derived from the Q4_K_M release."""
    return _fetched("gemma3-f16")


@pytest.fixture(scope="session")
def smollm2_f32_path() -> Path:
    """SmolLM2-135M-Instruct F32 derived from the Q4_1 release (a bandwidth-bound target here)."""
    return _fetched("smollm2-f32")


@pytest.fixture(scope="session")
def gemma_f32_path() -> Path:
    """Gemma-3-270M F32 derived from the Q4_K_M release (a bandwidth-bound target here)."""
    return _fetched("gemma3-f32")


@pytest.fixture(scope="session")
def smollm2_plain_counts(smollm2_path: Path):
    """The plain side of every chi-square test of test_real_sampling.py's setup (SmolLM2, its prompt
    and sampling, N_RUNS seeded runs), computed once per session: plain decoding never calls the
    drafter, so it is the same sample whichever drafter a test loads (test_convert_eagle3.py's too)."""
    from test_real_sampling import N_RUNS, PLAIN_SEED0, run_many

    import edgespec

    with edgespec.load(smollm2_path, drafter=None, n_ctx=256, threads=1) as engine:
        counts, stats = run_many(engine, range(PLAIN_SEED0, PLAIN_SEED0 + N_RUNS), speculative=False)
    assert all(s.n_drafted == 0 for s in stats)
    print(f"\nplain: {N_RUNS} runs, {len(counts)} distinct pairs, top {counts.most_common(3)}")
    return counts


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """2-layer random llama with SmolLM2's tokenizer (seed 0)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny_target.gguf"
    return build_tiny_llama(out, vocab_source=smollm2_path, seed=0)


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """tiny_target + 0.1 × noise (shared token_embd): greedy agreement ≈ 0.64, sum(min(p, q)) ≈ 0.74."""
    out = tmp_path_factory.mktemp("tiny") / "tiny_drafter.gguf"
    return build_tiny_llama(out, vocab_source=smollm2_path, seed=1, base_seed=0, perturb=0.1)


@pytest.fixture(scope="session")
def tiny_unrelated(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """Same architecture and vocabulary as tiny_target, independent weights (seed 1)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny_unrelated.gguf"
    return build_tiny_llama(out, vocab_source=smollm2_path, seed=1)
