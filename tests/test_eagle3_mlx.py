"""The MLX EAGLE-3 head (edgespec.heads.eagle3_mlx) against the numpy reference (heads.eagle3) on
random heads: every option, GQA, partial RoPE, d2t, cache continuation and rollback. No model files."""

from __future__ import annotations

import time

import numpy as np
import pytest
from head_oracles import close_rel

mx = pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

from edgespec.heads.eagle3 import Eagle3Config, Eagle3Head, random_tensors  # noqa: E402
from edgespec.heads.eagle3_mlx import MlxEagle3Head  # noqa: E402

V, VD, H, HT = 100, 40, 32, 24


def _pair(seed: int = 0, rope_freqs: tuple[float, ...] | None = None, **kw) -> tuple[Eagle3Head, MlxEagle3Head]:
    """The same random head in numpy and on MLX (non-trivial norms, its own token embeddings;
    ``rope_freqs``: llama3 scaling's divisors)."""
    base = dict(n_embd=H, n_head=4, n_head_kv=2, n_ff=48, n_embd_tgt=HT, target_layers=(2, 4, 5),
                n_vocab=V, n_draft_vocab=VD)
    cfg = Eagle3Config(**(base | kw))
    rng = np.random.default_rng(100 + seed)
    d2t = (np.sort(rng.choice(cfg.n_vocab, cfg.n_draft_vocab, replace=False))
           if cfg.n_draft_vocab < cfg.n_vocab else None)
    t = random_tensors(cfg, seed=seed, d2t=d2t)
    if rope_freqs is not None:
        t["rope_freqs.weight"] = np.array(rope_freqs, np.float32)
    for name in ("blk.0.attn_norm.weight", "blk.0.attn_norm_2.weight", "output_norm.weight",
                 "blk.0.ffn_norm.weight", "enc.output_norm.weight"):
        if name in t:
            t[name] = (1 + 0.3 * rng.standard_normal(t[name].shape)).astype(np.float32)
    embd = rng.standard_normal((cfg.n_vocab, cfg.n_embd), dtype=np.float32)
    return Eagle3Head(cfg, t, tok_embd=embd), MlxEagle3Head(cfg, t, tok_embd=embd)


def _inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, n).tolist(), 2 * rng.standard_normal((n, 3 * HT), dtype=np.float32)


@pytest.mark.parametrize("kw", [{}, {"norm_before_fc": True}, {"norm_before_residual": True},
                                {"n_head_kv": 4, "n_rot": 4}, {"n_draft_vocab": V, "rope_base": 500.0},
                                {"rope_base": 500000.0, "rope_freqs": (1.0, 2.5, 8.0, 8.0)}],
                         ids=["plain", "norm_before_fc", "norm_before_residual", "mha_partial_rope", "no_d2t",
                              "llama3_rope_freqs"])
def test_mlx_head_equals_numpy(kw):
    ref, head = _pair(**kw)
    tokens, feats = _inputs(9)
    g_ref, g = ref.encode(feats), head.encode(feats)
    close_rel(g, g_ref)
    want, want_h = ref.decode(tokens, g_ref)
    got, got_h = head.decode(tokens, g)
    diff = close_rel(got, want)
    close_rel(got_h, want_h)
    assert head.n_past == ref.n_past == 9 and got.dtype == got_h.dtype == np.float32
    print(f"{kw}: MLX vs numpy logits {diff:.1e} of the range")


def test_two_calls_equal_one_and_rows_last():
    """Cache continuation: 5 pairs then 4 (rows "last") == 9 in one call; a chain step from h."""
    ref, head = _pair(seed=1)
    tokens, feats = _inputs(9, seed=1)
    g = ref.encode(feats)
    want, want_h = ref.decode(tokens, g)
    first, _ = head.decode(tokens[:5], g[:5])
    last, last_h = head.decode(tokens[5:], g[5:], rows="last")
    close_rel(first, want[:5])
    close_rel(last, want[-1:])
    close_rel(last_h, want_h[-1:])
    step_ref, _ = ref.decode([int(np.argmax(want[-1]))], want_h[-1:])
    step, _ = head.decode([int(np.argmax(last[0]))], last_h)
    close_rel(step, step_ref)


def test_truncate_then_redo_equals_a_fresh_run():
    ref, head = _pair(seed=2)
    tokens, feats = _inputs(8, seed=2)
    other, other_feats = _inputs(3, seed=3)
    g, g_other = ref.encode(feats), ref.encode(other_feats)
    head.decode(tokens, g)
    head.truncate(5)
    assert head.n_past == 5
    head.truncate(7)  # no-op past the end
    assert head.n_past == 5
    got, _ = head.decode(other, g_other)
    ref.decode(tokens[:5], g[:5])
    want, _ = ref.decode(other, g_other)
    close_rel(got, want)
    head.truncate(0)
    close_rel(head.decode(tokens[:2], g[:2])[0], _pair(seed=2)[0].decode(tokens[:2], g[:2])[0])


def test_mx_token_embeddings_and_bad_inputs():
    ref, head = _pair()
    cfg = ref.config
    t = {k: v for k, v in ref.tensors.items()}
    other = MlxEagle3Head(cfg, t, tok_embd=mx.array(ref.tok_embd))  # an MLX target's weight, no copy
    tokens, feats = _inputs(4)
    g = ref.encode(feats)
    close_rel(other.decode(tokens, g)[0], ref.decode(tokens, g)[0])
    with pytest.raises(ValueError, match="token embeddings"):
        MlxEagle3Head(cfg, t)
    with pytest.raises(ValueError, match="features must be"):
        head.encode(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="g must be"):
        head.decode([1, 2], np.zeros((1, H), np.float32))


def test_chain_step_cost():
    """One chain step (a one-pair decode + argmax) on a tiny head: reported, loosely bounded."""
    _, head = _pair(n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_embd_tgt=64, n_vocab=2048, n_draft_vocab=2048)
    g = np.zeros((1, 64), np.float32)
    head.decode(list(range(32)), np.zeros((32, 64), np.float32))
    times = []
    for _ in range(21):
        t0 = time.perf_counter()
        logits, g = head.decode([1], g)
        int(np.argmax(logits[0]))
        times.append(time.perf_counter() - t0)
    ms = 1000 * float(np.median(times[1:]))
    print(f"MLX head chain step (H 64, V 2048, 32-53 cached positions): {ms:.2f} ms")
    assert ms < 50
