"""Shared fixtures: the fetched real models (fail loudly when missing) and tiny GGUFs built from them."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf_fixtures import build_tiny_llama

from edgespec.errors import ModelLoadError
from edgespec.models import edgespec_home, resolve_model

# Every test starts from a clean state: $EDGESPEC_HOME is a fresh temporary folder holding only a link
# to the fetched models, so no test reads a cost profile, pair record or conversion that an earlier run
# (or the user) left, and none writes into the user's cache. A test that needs a profile makes it.
USER_HOME = edgespec_home()
TEST_HOME = Path(tempfile.mkdtemp(prefix="edgespec-test-home-"))
(TEST_HOME / "models").symlink_to((USER_HOME / "models").resolve(), target_is_directory=True)
os.environ["EDGESPEC_HOME"] = str(TEST_HOME)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(TEST_HOME, ignore_errors=True)  # the link only: rmtree does not follow it


def _fetched(name: str) -> Path:
    try:
        return resolve_model(name)
    except ModelLoadError as err:
        pytest.fail(f"{err} (this test needs the real models)", pytrace=False)


def _model(fixture: str, name: str, doc: str) -> Any:
    """A session fixture `fixture`: the path of the fetched model `name`."""
    def path() -> Path:
        return _fetched(name)
    path.__doc__ = doc
    return pytest.fixture(scope="session", name=fixture)(path)


smollm2_path = _model("smollm2_path", "smollm2", "SmolLM2-135M-Instruct Q4_1 (fetched).")
gemma_q4_path = _model("gemma_q4_path", "gemma3", "Gemma-3-270M base, Q4_K_M release (fetched).")
gemma_q8_path = _model("gemma_q8_path", "gemma3-q8_0", "Gemma-3-270M Q8_0 derived from the Q4_K_M release.")
gemma_f16_path = _model("gemma_f16_path", "gemma3-f16", "Gemma-3-270M F16 derived from the Q4_K_M release.")
smollm2_f32_path = _model("smollm2_f32_path", "smollm2-f32", "SmolLM2-135M-Instruct F32 derived from the Q4_1 "
                          "release (a bandwidth-bound target here).")
gemma_f32_path = _model("gemma_f32_path", "gemma3-f32", "Gemma-3-270M F32 derived from the Q4_K_M release (a "
                        "bandwidth-bound target here).")


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


def _tiny(fixture: str, doc: str, **build: Any) -> Any:
    """A session fixture `fixture`: a tiny random llama with SmolLM2's tokenizer (gguf_fixtures.build_tiny_llama)."""
    def path(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
        return build_tiny_llama(tmp_path_factory.mktemp("tiny") / f"{fixture}.gguf", vocab_source=smollm2_path, **build)
    path.__doc__ = doc
    return pytest.fixture(scope="session", name=fixture)(path)


tiny_target = _tiny("tiny_target", "2-layer random llama with SmolLM2's tokenizer (seed 0).", seed=0)
tiny_drafter = _tiny("tiny_drafter", "tiny_target + 0.1 × noise (shared token_embd): greedy agreement ≈ 0.64, "
                     "sum(min(p, q)) ≈ 0.74.", seed=1, base_seed=0, perturb=0.1)
tiny_unrelated = _tiny("tiny_unrelated", "Same architecture and vocabulary as tiny_target, independent weights "
                       "(seed 1).", seed=1)
tiny8 = _tiny("tiny8", "8-layer random llama (n_embd 64), F32 weights: EAGLE-3's default layers are (2, 4, 5).",
              n_layer=8, seed=0)


@pytest.fixture(scope="session")
def tiny_head(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Callable[[str], tuple[Path, Path]]:
    """name → (a tiny target, a head GGUF for it), each built once a session (head_cases.build_tiny_head:
    "eagle3", "dflash", "dspark", "dspark-q8_0")."""
    from head_cases import build_tiny_head

    d, built = tmp_path_factory.mktemp("heads"), {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in built:
            built[name] = build_tiny_head(name, d, smollm2_path)
        return built[name]
    return get


@pytest.fixture(scope="session")
def vocab100(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF holding only a 100-token tokenizer (what a head copies from its target), mask id 7."""
    import gguf

    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(100)])
    w.add_bos_token_id(1)
    w.add_mask_token_id(7)  # a DFlash head's own mask id must win
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
