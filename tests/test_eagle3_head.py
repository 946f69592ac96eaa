"""The numpy EAGLE-3 head (edgespec.heads.eagle3): primitives, KV cache semantics, d2t, options.
No model files needed: small heads with their own token embeddings."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.heads.eagle3 import Eagle3Config, Eagle3Head, random_tensors
from edgespec.heads.numpy_ops import rms_norm, rope_norm

V, VD, H = 100, 40, 32


def _config(**kw) -> Eagle3Config:
    base = dict(n_embd=H, n_head=4, n_head_kv=2, n_ff=48, n_embd_tgt=24, target_layers=(2, 4, 5),
                n_vocab=V, n_draft_vocab=VD)
    return Eagle3Config(**(base | kw))


def _head(seed: int = 0, **kw) -> Eagle3Head:
    cfg = _config(**kw)
    rng = np.random.default_rng(100 + seed)
    d2t = np.sort(rng.choice(V, cfg.n_draft_vocab, replace=False)) if cfg.n_draft_vocab < V else None
    t = random_tensors(cfg, seed=seed, d2t=d2t)
    t["token_embd.weight"] = rng.standard_normal((V, H), dtype=np.float32)
    for name in ("blk.0.attn_norm.weight", "blk.0.attn_norm_2.weight", "output_norm.weight"):
        t[name] = (1 + 0.3 * rng.standard_normal(H)).astype(np.float32)  # non-trivial norms
    return Eagle3Head(cfg, t)


def _inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, n).tolist(), rng.standard_normal((n, 3 * 24), dtype=np.float32)


def test_rope_norm_rotates_adjacent_pairs():
    x = np.arange(1, 9, dtype=np.float32).reshape(1, 1, 8)  # one head, head_dim 8
    np.testing.assert_allclose(rope_norm(x, np.array([0]), 8, 10000.0), x)
    y = rope_norm(x, np.array([1]), 4, 10000.0)  # n_rot 4: dims 4..7 pass through
    c, s = np.cos(1.0), np.sin(1.0)
    assert y[0, 0, 0] == pytest.approx(1 * c - 2 * s, rel=1e-6)  # pair (x0, x1), angle 1·base^0
    assert y[0, 0, 1] == pytest.approx(1 * s + 2 * c, rel=1e-6)
    c2, s2 = np.cos(1e-2), np.sin(1e-2)  # pair (x2, x3), angle base^(-2/4) = 0.01
    assert y[0, 0, 2] == pytest.approx(3 * c2 - 4 * s2, rel=1e-6)
    np.testing.assert_array_equal(y[0, 0, 4:], x[0, 0, 4:])


def test_rope_norm_freq_factors_divide_the_inverse_frequencies():
    """ggml_rope_ext's freq_factors: pair i turns by pos·base^(−2i/n_rot) / ff[i] (llama3 scaling)."""
    x = np.arange(1, 9, dtype=np.float32).reshape(1, 1, 8)
    ff = np.array([1.0, 2.0, 8.0, 3.5], np.float32)
    y = rope_norm(x, np.array([5]), 8, 10000.0, ff)
    for i in range(4):
        theta = 5 * 10000.0 ** (-2 * i / 8) / ff[i]
        assert y[0, 0, 2 * i] == pytest.approx(x[0, 0, 2 * i] * np.cos(theta) - x[0, 0, 2 * i + 1] * np.sin(theta),
                                               rel=1e-5)
    np.testing.assert_allclose(rope_norm(x, np.array([5]), 8, 10000.0, np.ones(4, np.float32)),
                               rope_norm(x, np.array([5]), 8, 10000.0))


def test_rope_freqs_tensor_changes_the_function_and_is_checked():
    tokens, feats = _inputs(4)
    plain = _head()
    base, _ = plain.decode(tokens, plain.encode(feats))
    t = dict(plain.tensors, **{"rope_freqs.weight": np.full(4, 8.0, np.float32)})  # head_dim 8: 4 pairs
    scaled = Eagle3Head(plain.config, t)
    changed, _ = scaled.decode(tokens, scaled.encode(feats))
    finite = np.isfinite(base)
    assert np.abs(changed[finite] - base[finite]).max() > 1e-3
    with pytest.raises(ValueError, match=r"rope_freqs.weight has shape \(3,\), expected \(4,\)"):
        Eagle3Head(plain.config, dict(t, **{"rope_freqs.weight": np.ones(3, np.float32)}))
    with pytest.raises(ValueError, match="positive divisors"):
        Eagle3Head(plain.config, dict(t, **{"rope_freqs.weight": np.zeros(4, np.float32)}))


def test_rms_norm():
    x = np.array([[3.0, 4.0]], np.float32)
    np.testing.assert_allclose(rms_norm(x, np.array([1.0, 2.0], np.float32), 0.0),
                               [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]], rtol=1e-6)


def test_incremental_decode_equals_one_batch():
    """KV cache semantics: n pairs in one call == the same pairs one per call."""
    tokens, feats = _inputs(7)
    a, b = _head(), _head()
    g = a.encode(feats)
    la, ha = a.decode(tokens, g)
    rows = [b.decode([t], g[i:i + 1]) for i, t in enumerate(tokens)]
    np.testing.assert_allclose(np.concatenate([r[0] for r in rows]), la, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([r[1] for r in rows]), ha, rtol=1e-5, atol=1e-5)
    assert a.n_past == b.n_past == 7


def test_causal_and_rollback():
    """A row depends only on earlier pairs; truncate + redo == a fresh run of the kept sequence."""
    tokens, feats = _inputs(8)
    other_tokens, other_feats = _inputs(3, seed=1)
    h = _head()
    g, g_other = h.encode(feats), h.encode(other_feats)
    full, _ = h.decode(tokens, g)
    h.truncate(5)
    assert h.n_past == 5
    redo, _ = h.decode(other_tokens, g_other)
    fresh = _head()
    first, _ = fresh.decode(tokens[:5], g[:5])
    want, _ = fresh.decode(other_tokens, g_other)
    np.testing.assert_allclose(first, full[:5], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(redo, want, rtol=1e-5, atol=1e-5)


def test_d2t_scatters_draft_logits_into_the_target_vocabulary():
    h = _head()
    tokens, feats = _inputs(3)
    logits, hidden = h.decode(tokens, h.encode(feats))
    finite = np.isfinite(logits)
    assert (finite.sum(axis=1) == VD).all()
    assert set(np.nonzero(finite[0])[0]) == set(h.d2t.tolist())
    t = h.tensors
    compact = rms_norm(hidden, t["output_norm.weight"], h.config.rms_eps) @ t["output.weight"].T
    np.testing.assert_allclose(logits[:, h.d2t], compact, rtol=1e-5, atol=1e-5)


def test_chain_drafting_feeds_the_prenorm_state_back():
    """Drafting on from the head's own output: the next g is the previous pre-norm h."""
    h = _head()
    tokens, feats = _inputs(4)
    g = h.encode(feats)
    h.decode(tokens[1:], g[:-1])  # pairs (t_{p+1}, g_p), p = 0..2
    logits, prev = h.decode([tokens[-1]], g[-1:])
    drafted = []
    for _ in range(3):
        tok = int(np.argmax(logits[0]))
        assert tok in set(h.d2t.tolist())
        drafted.append(tok)
        logits, prev = h.decode([tok], prev)
    assert h.n_past == 3 + 1 + 3 and len(drafted) == 3


@pytest.mark.parametrize("option", ["norm_before_residual", "norm_before_fc"])
def test_options_change_the_function(option: str):
    tokens, feats = _inputs(3)
    plain = _head()
    base, _ = plain.decode(tokens, plain.encode(feats))
    cfg = _config(**{option: True})
    t = dict(plain.tensors)
    if option == "norm_before_fc":
        t["enc.output_norm.weight"] = np.ones(3 * 24, np.float32)
    other = Eagle3Head(cfg, t)
    changed, _ = other.decode(tokens, other.encode(feats))
    finite = np.isfinite(base)
    assert np.abs(changed[finite] - base[finite]).max() > 1e-3


def test_full_vocab_head_has_no_d2t():
    h = _head(n_draft_vocab=V)
    assert "d2t" not in h.tensors
    logits, _ = h.decode([1, 2], h.encode(_inputs(2)[1]))
    assert np.isfinite(logits).all()


def test_bad_shapes_are_refused():
    cfg = _config()
    t = random_tensors(cfg)
    with pytest.raises(ValueError, match="token embeddings"):
        Eagle3Head(cfg, t)
    bad = dict(t, **{"fc.weight": np.zeros((H, 10), np.float32)})
    with pytest.raises(ValueError, match="fc.weight has shape"):
        Eagle3Head(cfg, bad, tok_embd=np.zeros((V, H), np.float32))
    with pytest.raises(ValueError, match="distinct target ids"):
        Eagle3Head(cfg, dict(t, d2t=np.zeros(VD, np.int64)), tok_embd=np.zeros((V, H), np.float32))
    with pytest.raises(ValueError, match="exactly 3"):
        _config(target_layers=(1, 2))
    h = _head()
    with pytest.raises(ValueError, match="features must be"):
        h.encode(np.zeros((2, 5), np.float32))
