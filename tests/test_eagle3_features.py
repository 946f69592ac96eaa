"""Target features (hidden states at 3 layers) from the llama.cpp backend: both capture paths,
checked against a numpy forward, against each other, across batching and rollback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from llama_numpy import ExactAttention, LlamaWeights, llama_forward, rollback_features

from edgespec.backends.capture_c import compiled_callback, find_compiler
from edgespec.backends.llama_features import EXT_SYMBOLS, LlamaFeatureBackend, eagle3_layer_ids, ext_api
from edgespec.errors import BackendError

pytestmark = pytest.mark.real

TOKENS = [1, 504, 2113, 6356, 17, 314, 2595, 4110, 282, 253, 9, 3000]


def test_mangled_symbols_are_exported():
    api = ext_api()
    assert api is not None, f"libllama lacks one of {sorted(EXT_SYMBOLS.values())}"


def test_eagle3_default_layers():
    assert eagle3_layer_ids(30) == (2, 15, 27)  # SmolLM2-135M
    assert eagle3_layer_ids(18) == (2, 9, 15)  # Gemma-3-270M
    with pytest.raises(ValueError, match="at least 5 layers"):
        eagle3_layer_ids(2)


@pytest.mark.parametrize("method", ["ext", "cb_eval"])
def test_features_equal_numpy_forward(tiny8: Path, method: str):
    inputs, logits = llama_forward(tiny8, TOKENS)
    with ExactAttention(tiny8, method=method, kv_type="f32", n_ctx=64, threads=1) as b:
        assert b.feature_method == method and b.feature_layers == (2, 4, 5)
        got_logits = b.eval(TOKENS, rows="all")
        feats = b.features()
    want = np.concatenate([inputs[i] for i in (2, 4, 5)], axis=1)  # input of layer L = output of L-1
    assert feats.shape == (len(TOKENS), 3 * 64)
    np.testing.assert_allclose(feats, want, rtol=0, atol=2e-5)  # measured 2.1e-6 (|x| ≤ 7.6)
    np.testing.assert_allclose(got_logits, logits, rtol=0, atol=1e-4)  # measured 9.4e-6


def test_features_with_flash_attention_stay_close(tiny8: Path):
    """The default context (flash attention on, F16 Q·K): the same features within F16 rounding."""
    inputs, _ = llama_forward(tiny8, TOKENS)
    with LlamaFeatureBackend(tiny8, kv_type="f32", n_ctx=64, threads=1) as b:
        b.eval(TOKENS, rows="none")
        feats = b.features()
    want = np.concatenate([inputs[i] for i in (2, 4, 5)], axis=1)
    np.testing.assert_allclose(feats, want, rtol=0, atol=2e-2)  # measured 4.4e-3


def test_ext_and_cb_eval_agree_bit_for_bit(smollm2_path: Path):
    """Both read the same computed tensor: identical rows, across n_batch chunks and row choices."""
    out = {}
    for method in ("ext", "cb_eval"):
        with LlamaFeatureBackend(smollm2_path, method=method, n_ctx=128, n_batch=8, threads=1) as b:
            toks = b.tokenize("The quick brown fox jumps over the lazy dog, then it sleeps.")
            b.eval(toks[:5], rows="none")
            b.eval(toks[5:], rows="last")  # > n_batch tokens: two llama_decode chunks
            out[method] = b.features()
            assert out[method].shape == (len(toks), 3 * 576)
    assert np.array_equal(out["ext"], out["cb_eval"])


def test_last_layer_input_reproduces_logits(smollm2_path: Path):
    """Independent check on the real model: the captured input of layer 29 (SmolLM2's last), run
    through a numpy layer 29 + final norm + LM head (dequantized weights), gives llama.cpp's logits
    up to its 8-bit activation quantization; the input of layer 28 in its place does not."""
    w = LlamaWeights.load(smollm2_path, layers=[29])
    with LlamaFeatureBackend(smollm2_path, layers=[2, 28, 29], n_ctx=128, threads=1) as b:
        toks = b.tokenize("The capital of France is Paris. The capital of Italy is")
        logits = b.eval(toks, rows="all")
        f = b.features()
    pos = np.arange(len(toks))
    ok = w.logits(w.layer(29, f[:, 2 * 576:], pos))
    wrong = w.logits(w.layer(29, f[:, 576:2 * 576], pos))
    assert np.abs(ok - logits).max() < 1.5  # measured 0.61 on a logit range of 54
    assert (ok.argmax(1) == logits.argmax(1)).all()
    assert np.abs(wrong - logits).max() > 10  # measured 22


def test_batch_equals_single_token_evals(smollm2_path: Path):
    """Features of one k-token eval == features of k one-token evals (SmolLM2 Q4_1: exact)."""
    with LlamaFeatureBackend(smollm2_path, n_ctx=128, threads=1) as b:
        toks = b.tokenize("def fibonacci(n):\n    if n < 2:\n        return n")
        b.eval(toks[:4], rows="last")
        b.eval(toks[4:], rows="all")
        batched = b.features()
        b.truncate(4)
        for t in toks[4:]:
            b.eval([t], rows="last")
        assert np.array_equal(b.features(), batched)


@pytest.mark.parametrize("method", ["ext", "cb_eval"])
def test_rows_follow_positions_after_rollback(tiny8: Path, method: str):
    """Draft 4, keep 1, append 2 others: rows equal a fresh run of the kept sequence, and rows past
    n_past are gone. (The fresh run evaluates the kept draft token alone, not in a 4-token batch;
    F32 matmuls differ by ~1e-6 between those batch shapes, a wrong row would differ by ~1.)"""
    with LlamaFeatureBackend(tiny8, method=method, n_ctx=64, threads=1) as b:
        got = rollback_features(b, TOKENS)
        b.eval(TOKENS[:6], rows="last")
        b.eval(TOKENS[6:7], rows="all")  # the kept draft token
        b.eval([777, 4242], rows="all")
        np.testing.assert_allclose(got, b.features(), rtol=0, atol=1e-4)  # measured 1.2e-6


def test_llama_feature_backend_is_a_feature_backend_without_native_weights(tiny8: Path):
    """base.FeatureBackend: a head on llama.cpp borrows weights through ctx_other, so none are lent."""
    from edgespec.backends.base import FeatureBackend

    with LlamaFeatureBackend(tiny8, n_ctx=64, threads=1) as b:
        assert isinstance(b, FeatureBackend)
        assert b.token_embeddings() is None and b.lm_head_weights() is None


def test_cb_eval_recovers_from_a_stale_address_memo(tiny8: Path):
    """The callback's node-address memo gone stale (as if a rebuilt graph had moved every node): the
    decode is redone with fresh names and the rows are right; the memo learns the new addresses."""
    with LlamaFeatureBackend(tiny8, method="cb_eval", compiled=False, kv_type="f32", n_ctx=64, threads=1) as b:
        assert b.capture_impl == "python"
        b.eval(TOKENS[:3], rows="last")
        b.eval(TOKENS[3:6], rows="last")
        want = b.features()
        cap = b._capture
        assert cap is not None and sum(cap._wanted.values()) >= 3
        b.truncate(3)
        cap._wanted = dict.fromkeys(cap._wanted, False)
        b.eval(TOKENS[3:6], rows="last")
        np.testing.assert_array_equal(b.features(), want)
        assert b.n_past == 6 and sum(cap._wanted.values()) >= 3


def test_compiled_and_python_callbacks_agree_bit_for_bit(tiny8: Path):
    """The compiled cb_eval callback (built here: this machine has a C compiler) copies the same
    tensors as the Python one, through batches, single steps and rollbacks."""
    if find_compiler() is None:
        pytest.skip("no C compiler: only the Python callback can run here")
    out = {}
    for compiled in (True, False):
        with LlamaFeatureBackend(tiny8, method="cb_eval", compiled=compiled, n_ctx=64, threads=1) as b:
            b.eval(TOKENS[:6], rows="last")
            b.eval(TOKENS[6:10], rows="all")
            b.truncate(7)
            b.eval([777], rows="all")
            b.eval([4242, 99, 5], rows="all")
            out[b.capture_impl] = b.features()
    assert sorted(out) == ["c", "python"]
    assert out["c"].shape == (11, 3 * 64) and np.array_equal(out["c"], out["python"])


@pytest.mark.parametrize("why", ["EDGESPEC_NO_CC", "compiler fails", "unwritable cache"])
def test_without_a_compiled_callback_the_python_one_runs(tiny8: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, why: str):
    if why == "EDGESPEC_NO_CC":
        monkeypatch.setenv("EDGESPEC_NO_CC", "1")
    elif why == "compiler fails":
        monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
        monkeypatch.setenv("CC", "false")
    else:
        (tmp_path / "home").write_text("a file, not a directory")
        monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    compiled_callback.cache_clear()
    try:
        assert compiled_callback() is None
        with LlamaFeatureBackend(tiny8, method="cb_eval", n_ctx=64, threads=1) as b:
            assert b.capture_impl == "python"
            b.eval(TOKENS, rows="last")
            assert b.features().shape == (len(TOKENS), 3 * 64)
    finally:
        compiled_callback.cache_clear()


def test_gemma3_takes_the_cb_eval_path(gemma_q4_path: Path):
    """gemma3's graph sets no layer inputs: "auto" picks cb_eval, "ext" is refused (it would abort)."""
    with pytest.raises(BackendError, match="aborts the process for arch 'gemma3'"):
        LlamaFeatureBackend(gemma_q4_path, method="ext", n_ctx=64)
    with LlamaFeatureBackend(gemma_q4_path, n_ctx=64, threads=1) as b:
        assert (b.feature_method, b.feature_layers, b.n_embd) == ("cb_eval", (2, 9, 15), 640)
        assert b.capture_impl == ("c" if compiled_callback() is not None else "python")
        toks = b.tokenize("The history of the Roman Empire")
        b.eval(toks[:3], rows="last")
        b.eval(toks[3:], rows="last")
        f = b.features()
        assert f.shape == (len(toks), 3 * 640) and np.isfinite(f).all()
        b.truncate(3)
        b.eval(toks[3:], rows="last")
        assert np.array_equal(b.features(), f)  # rolled back and redone with the same batches


def test_bad_layer_ids_are_refused(tiny8: Path):
    for layers in ([0, 2, 4], [2, 4, 8]):
        with pytest.raises(ValueError, match=r"must be in 1\.\.7"):
            LlamaFeatureBackend(tiny8, layers=layers, n_ctx=64)
    with pytest.raises(ValueError, match="method"):
        LlamaFeatureBackend(tiny8, method="gpu", n_ctx=64)  # type: ignore[arg-type]
