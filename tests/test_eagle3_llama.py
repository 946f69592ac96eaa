"""The EAGLE-3 head run by libllama (edgespec.heads.eagle3_llama) equals the numpy reference on the
same target features, driven the way llama.cpp's common/speculative.cpp drives it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_fixtures import build_tiny_llama

from edgespec.backends.llama_features import LlamaFeatureBackend
from edgespec.gguf_file import read_gguf
from edgespec.heads.eagle3 import Eagle3Config, Eagle3Head, random_tensors
from edgespec.heads.eagle3_llama import LlamaEagle3Head
from edgespec.heads.gguf_io import read_eagle3_gguf, write_eagle3_gguf

pytestmark = pytest.mark.real

TOKENS = [1, 504, 2113, 6356, 17, 314, 2595, 4110, 282, 253, 9, 3000]
N_VOCAB = 49152  # SmolLM2's tokenizer, shared by the tiny target


class _ExactTarget(LlamaFeatureBackend):
    def _configure_context(self, cp):
        super()._configure_context(cp)
        cp.flash_attn_type = 0  # F32 attention: the tiny target's features match numpy to ~1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> tuple[Path, Path, np.ndarray]:
    """(8-layer F32 target with n_embd 64, an F32 random head for it, the target's token_embd)."""
    d = tmp_path_factory.mktemp("e3llama")
    target = build_tiny_llama(d / "tiny8.gguf", vocab_source=smollm2_path, n_layer=8, seed=0)
    cfg = Eagle3Config(n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_embd_tgt=64, target_layers=(2, 4, 5),
                       n_vocab=N_VOCAB, n_draft_vocab=1000)
    d2t = np.sort(np.random.default_rng(3).choice(N_VOCAB, 1000, replace=False))
    head = write_eagle3_gguf(d / "head.gguf", cfg, random_tensors(cfg, seed=1, d2t=d2t), vocab_source=smollm2_path,
                             weight_type="f32")
    return target, head, read_gguf(target).tensor("token_embd.weight")


def _finite_close(a: np.ndarray, b: np.ndarray, atol: float) -> float:
    """Same −inf pattern (the d2t scatter), finite entries within atol; returns the max difference."""
    assert np.array_equal(np.isfinite(a), np.isfinite(b))
    diff = float(np.abs(a[np.isfinite(a)] - b[np.isfinite(b)]).max())
    assert diff <= atol, diff
    return diff


@pytest.mark.parametrize("exact", [True, False])
def test_llama_head_equals_numpy_head_through_a_speculative_cycle(tiny, exact: bool):
    """Prefill pairs (t_{p+1}, g_p), a 4-token greedy draft chain on the pre-norm state, rollback
    to 2 accepted drafts and a new chain: libllama and numpy agree at every step.
    exact: F32 attention and KV (measured ≤ 1e-6); else llama.cpp's defaults, flash attention and
    an F16 KV cache (measured 6.5e-4 on logits of magnitude ≤ 4)."""
    target_path, head_path, tok_embd = tiny
    cfg, tensors = read_eagle3_gguf(head_path)
    atol = 1e-5 if exact else 5e-3
    cls = _ExactTarget if exact else LlamaFeatureBackend
    with cls(target_path, kv_type="f32" if exact else "f16", n_ctx=64, threads=1) as target:
        assert target.feature_layers == (2, 4, 5) == cfg.target_layers
        target.eval(TOKENS, rows="last")
        feats = target.features()
        ref = Eagle3Head(cfg, tensors, tok_embd=tok_embd)
        with LlamaEagle3Head(head_path, target, kv_type="f32" if exact else "f16", flash_attn=not exact,
                             threads=1) as head:
            assert head.target_layers == (2, 4, 5)
            g_ref, g_ll = ref.encode(feats), head.encode(feats)
            np.testing.assert_allclose(g_ll, g_ref, rtol=0, atol=1e-5)  # fc alone: F32 either way
            lr, _ = ref.decode(TOKENS[1:], g_ref[:-1])
            ll, _ = head.decode(TOKENS[1:], g_ll[:-1])
            _finite_close(ll, lr, atol)

            def chain(tok: int, g_r: np.ndarray, g_l: np.ndarray, n: int) -> list[int]:
                out = []
                for _ in range(n):
                    (lr, hr), (lq, hq) = ref.decode([tok], g_r), head.decode([tok], g_l)
                    _finite_close(lq, lr, atol)
                    np.testing.assert_allclose(hq, hr, rtol=0, atol=max(atol, 1e-5))
                    assert lq.argmax() == lr.argmax()
                    tok, g_r, g_l = int(lr.argmax()), hr, hq
                    out.append(tok)
                return out

            first = chain(42, g_ref[-1:], g_ll[-1:], 4)
            assert ref.n_past == head.n_past == len(TOKENS) - 1 + 4
            keep = len(TOKENS) - 1 + 2
            ref.truncate(keep)
            head.truncate(keep)
            assert head.n_past == keep
            # encoding after decoding: llama.cpp requires the encoder batch to continue the KV positions
            np.testing.assert_allclose(head.encode(feats[-3:]), ref.encode(feats[-3:]), rtol=0, atol=1e-5)
            lr, hr = ref.decode(TOKENS[-2:], g_ref[-2:], rows="last")
            lq, hq = head.decode(TOKENS[-2:], g_ll[-2:], rows="last")
            assert lr.shape == lq.shape == (1, N_VOCAB) and hq.shape == (1, 64)
            _finite_close(lq, lr, atol)
            ref.truncate(keep)
            head.truncate(keep)
            again = chain(first[1], g_ref[-1:], g_ll[-1:], 3)
            assert len(again) == 3


@pytest.mark.parametrize("weight_type, g_rel, logit_atol", [("f16", 1e-3, 5e-3), ("q8_0", 3e-2, 0.2)])
def test_llama_head_on_smollm2_within_llama_cpp_arithmetic(tmp_path: Path, smollm2_path: Path, weight_type: str,
                                                           g_rel: float, logit_atol: float):
    """A random F16 / Q8_0 head for SmolLM2 (H 576, V_d 4096) on real target features. llama.cpp
    rounds activations to F16 (F16 weights) or Q8_0 (Q8_0 weights) in its matmuls and SmolLM2's
    features reach |x| ≈ 2·10⁴, so g differs by 2.9e-4 (F16) / 1.1e-2 (Q8_0) relative to max|g|,
    logits by 1.3e-3 / 5.2e-2 (magnitude ≤ 4); top-1 agrees on every row."""
    cfg = Eagle3Config(n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_embd_tgt=576, target_layers=(2, 15, 27),
                       n_vocab=N_VOCAB, n_draft_vocab=4096)
    d2t = np.sort(np.random.default_rng(0).choice(N_VOCAB, 4096, replace=False))
    path = write_eagle3_gguf(tmp_path / "h.gguf", cfg, random_tensors(cfg, seed=5, d2t=d2t),
                             vocab_source=smollm2_path, weight_type=weight_type)
    cfg2, tensors = read_eagle3_gguf(path)  # the dequantized weights: what libllama multiplies by
    ref = Eagle3Head(cfg2, tensors, tok_embd=read_gguf(smollm2_path).tensor("token_embd.weight"))
    with LlamaFeatureBackend(smollm2_path, n_ctx=128, threads=1) as target:
        toks = target.tokenize("The capital of France is Paris. The capital of Italy is")
        target.eval(toks, rows="last")
        feats = target.features()
        with LlamaEagle3Head(path, target, threads=1) as head:
            g_ref, g_ll = ref.encode(feats), head.encode(feats)
            assert np.abs(g_ll - g_ref).max() <= g_rel * np.abs(g_ref).max()
            lr, _ = ref.decode(toks[1:], g_ref[:-1])
            ll, _ = head.decode(toks[1:], g_ll[:-1])
            _finite_close(ll, lr, logit_atol)
            assert (ll.argmax(1) == lr.argmax(1)).all()
