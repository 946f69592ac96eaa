"""Backend.eval_argmax: each row's argmax taken where the logits are (llama.cpp's greedy backend
sampler, MLX on the device) equals the host's argmax of the same rows from `eval`, through chunked
forwards, rollbacks and switches between the two modes; and it refuses an overflow as `eval` does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from recurrent_fixtures import recurrent_ggufs  # noqa: F401 (a fixture)

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.reference import ReferenceBackend
from edgespec.errors import ContextOverflowError


def _check_against_eval(a, b, prompt: list[int], probes: list[list[int]]) -> None:
    """`a` (eval_argmax) and `b` (eval) evaluate the same tokens; after each probe both roll back
    to the prompt, and `a` also answers one `eval` (a switch of modes) before the next probe."""
    a.eval(prompt, rows="none")
    b.eval(prompt, rows="none")
    for toks in probes:
        a.checkpoint()
        b.checkpoint()
        got = a.eval_argmax(toks)
        rows = b.eval(toks, rows="all")
        assert got.dtype == np.int64 and got.shape == (len(toks),)
        np.testing.assert_array_equal(got, np.argmax(rows, axis=1))
        assert a.n_past == b.n_past == len(prompt) + len(toks)
        a.truncate(len(prompt))
        b.truncate(len(prompt))
        np.testing.assert_array_equal(a.eval(toks[:1], rows="last"), b.eval(toks[:1], rows="last"))
        a.truncate(len(prompt))
        b.truncate(len(prompt))


def _probes(rng: np.random.Generator, n_vocab: int) -> list[list[int]]:
    return [[int(t) for t in rng.integers(0, n_vocab, n)] for n in (1, 9, 3, 21, 9)]


def test_llama_cpp_backend_argmax_equals_the_host_argmax(tiny_target: Path):
    """n_batch 8: a 21-token probe is decoded in three chunks, each with its own sampled rows."""
    with (LlamaCppBackend(tiny_target, n_ctx=256, threads=1, n_batch=8) as a,
          LlamaCppBackend(tiny_target, n_ctx=256, threads=1, n_batch=8) as b):
        prompt = a.tokenize("The weather today is sunny with a light breeze and")
        _check_against_eval(a, b, prompt, _probes(np.random.default_rng(0), a.n_vocab))
        a.truncate(0)
        a.eval(prompt, rows="none")
        with pytest.raises(ContextOverflowError):
            a.eval_argmax([1] * (a.n_ctx - a.n_past + 1))
        assert a.n_past == len(prompt)  # nothing was evaluated


def test_recurrent_llama_cpp_backend_argmax(recurrent_ggufs):  # noqa: F811
    """A hybrid (LFM2) target: eval_argmax after a checkpoint, rolled back by restore + replay."""
    path = recurrent_ggufs["lfm2"][0]
    with LlamaCppBackend(path, n_ctx=256, threads=1) as a, LlamaCppBackend(path, n_ctx=256, threads=1) as b:
        assert a.recurrent
        prompt = a.tokenize("Once upon a time, in a small village by the sea,")
        _check_against_eval(a, b, prompt, _probes(np.random.default_rng(1), a.n_vocab))


def test_reference_backend_argmax():
    a, b = ReferenceBackend(7, seed=3, recurrent=True), ReferenceBackend(7, seed=3, recurrent=True)
    _check_against_eval(a, b, [0, 1, 2, 3], _probes(np.random.default_rng(2), 7))


def test_mlx_backend_argmax(tmp_path: Path):
    pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")
    from mlx_fixtures import build_tiny_mlx

    from edgespec.backends.mlx import MlxBackend

    path = build_tiny_mlx(tmp_path / "tiny", seed=0)
    a, b = (MlxBackend(path, vocab=ReferenceBackend(6), n_batch=8) for _ in range(2))
    _check_against_eval(a, b, [0, 1, 2, 3, 4], _probes(np.random.default_rng(3), 6))
