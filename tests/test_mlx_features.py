"""Target features from the MLX backend (MlxFeatureBackend) against llama.cpp's (LlamaFeatureBackend)
on the same tiny F32 GGUF converted to MLX (marked real: the GGUF copies SmolLM2's tokenizer), across
chunking, row choices and rollback; and Gemma 3's scaled layer inputs on a tiny mlx-lm directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from llama_numpy import ExactAttention, rollback_features
from mlx_fixtures import own_mlx_home  # noqa: F401 (used by pytestmark)

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

from edgespec.backends.mlx_features import MlxFeatureBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("own_mlx_home")
TOKENS = [1, 504, 2113, 6356, 17, 314, 2595, 4110, 282, 253, 9, 3000]
TOL = 1e-3  # of the feature range (max - min over all rows)


def _rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / (b.max() - b.min()))


def _llama_features(path: Path, chunks: list[list[int]]) -> np.ndarray:
    with ExactAttention(path, kv_type="f32", n_ctx=64, threads=1) as b:
        for c in chunks:
            b.eval(c, rows="all")
        return b.features()


@pytest.mark.real
def test_features_match_llama_cpp(tiny8: Path):
    """Chunked MLX evaluation (n_batch 4, rows "none" then "last") gives llama.cpp's layer inputs."""
    want = _llama_features(tiny8, [TOKENS])
    with MlxFeatureBackend(tiny8, n_ctx=64, n_batch=4, threads=1) as b:
        assert b.feature_layers == (2, 4, 5) and (b.n_layer, b.n_embd) == (8, 64)
        assert b.eval(TOKENS[:5], rows="none").shape == (0, b.n_vocab)  # chunks of 4 + 1, no logits
        assert b.features().shape == (5, 3 * 64)
        b.eval(TOKENS[5:], rows="last")  # 4 + 3: a "none" chunk then a "last" one
        got = b.features()
    assert got.shape == want.shape == (len(TOKENS), 3 * 64) and got.dtype == np.float32
    diff = _rel_diff(got, want)
    print(f"MLX vs llama.cpp features: max |diff| = {diff:.2e} of the range {want.max() - want.min():.2f}")
    assert diff <= TOL  # measured 3.0e-7


@pytest.mark.real
def test_rows_follow_positions_after_truncate(tiny8: Path):
    """Draft 4, keep 1, append 2 others: rows past n_past are gone, the kept rows are unchanged and
    the re-evaluated ones equal llama.cpp's features of the kept sequence."""
    with MlxFeatureBackend(tiny8, layers=[1, 3, 7], n_ctx=64, threads=1) as b:
        got = rollback_features(b, TOKENS)
    with ExactAttention(tiny8, layers=[1, 3, 7], kv_type="f32", n_ctx=64, threads=1) as ref:
        ref.eval(TOKENS[:7] + [777, 4242], rows="all")
        want = ref.features()
    assert got.shape == want.shape == (9, 3 * 64)
    assert _rel_diff(got, want) <= TOL


@pytest.mark.real
def test_bad_layer_ids_are_refused(tiny8: Path):
    for layers in ([0, 2, 4], [2, 4, 8]):
        with pytest.raises(ValueError, match=r"must be in 1\.\.7"):
            MlxFeatureBackend(tiny8, layers=layers, n_ctx=64)


@pytest.mark.real
def test_token_embeddings_are_the_targets(tiny8: Path):
    """What the MLX head borrows: the target's unscaled token_embd, as the numpy head reads it."""
    from edgespec.backends.base import FeatureBackend
    from edgespec.gguf_file import read_gguf

    with MlxFeatureBackend(tiny8, n_ctx=64) as b:
        assert isinstance(b, FeatureBackend)
        emb = np.asarray(b.token_embeddings())
    np.testing.assert_array_equal(emb, read_gguf(tiny8).tensor("token_embd.weight"))


def test_gemma3_features_are_the_scaled_layer_inputs(tmp_path: Path):
    """Gemma 3 scales embeddings by √H before layer 0: the features are what layers 1 and 2 receive
    (checked by running the model's own layers on √H·embed), chunking and rollback included, and
    capturing leaves the logits as a plain MlxBackend gives them."""
    import mlx.core as mx
    from mlx_fixtures import build_tiny_mlx

    from edgespec.backends.mlx import MlxBackend
    from edgespec.backends.reference import ReferenceBackend

    d = build_tiny_mlx(tmp_path / "gemma", model_type="gemma3_text", seed=0)
    toks = [1, 4, 2, 5]  # within the sliding window: every layer sees the causal mask
    plain = MlxBackend(d, vocab=ReferenceBackend(6))
    want_logits = plain.eval(toks, rows="all")
    with MlxFeatureBackend(d, layers=(1, 2, 2), n_batch=3, vocab=ReferenceBackend(6)) as b:
        assert (b.n_layer, b.n_embd, b.feature_layers) == (3, 32, (1, 2, 2))
        np.testing.assert_allclose(b.eval(toks, rows="all"), want_logits, rtol=0, atol=1e-5)
        got = b.features()
        b.truncate(1)
        b.eval(toks[1:], rows="last")
        np.testing.assert_allclose(b.features(), got, rtol=0, atol=1e-5)
    body = plain.model.model
    h = body.embed_tokens(mx.array([toks])) * mx.array(32 ** 0.5, mx.bfloat16).astype(mx.float32)
    h1 = body.layers[0](h, "causal", None)
    h2 = body.layers[1](h1, "causal", None)
    np.testing.assert_allclose(got[:, :32], np.array(h1[0]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[:, 32:64], np.array(h2[0]), rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got[:, 64:], got[:, 32:64])
    assert np.abs(np.array(h1[0]) - np.array(body.layers[0](h / 32 ** 0.5, "causal", None)[0])).max() > 1e-2


def test_lm_head_weights_are_the_targets(tmp_path: Path):
    """What an MLX DFlash head without its own LM head borrows: lm_head's weight, dequantized for a
    quantized model (then x·Wᵀ equals the quantized layer), or the tied token embeddings."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_fixtures import build_tiny_mlx

    from edgespec.backends.reference import ReferenceBackend

    d = build_tiny_mlx(tmp_path / "llama", n_vocab=6, seed=0)
    with MlxFeatureBackend(d, layers=(1,), vocab=ReferenceBackend(6)) as b:
        assert b.lm_head_weights() is b.model.lm_head.weight
        nn.quantize(b.model, group_size=32, bits=4)
        w = b.lm_head_weights()
        x = mx.random.normal((3, 32), key=mx.random.key(0))
        assert w.shape == (6, 32) and mx.abs(x @ w.T - b.model.lm_head(x)).max().item() < 1e-5
    config = json.loads((d / "config.json").read_text()) | {"tie_word_embeddings": True}
    (d / "config.json").write_text(json.dumps(config))  # mlx-lm's llama then drops lm_head.weight
    with MlxFeatureBackend(d, layers=(1,), vocab=ReferenceBackend(6)) as b:
        assert "lm_head" not in b.model and b.lm_head_weights() is b.token_embeddings()
