"""The numpy DFlash head (edgespec.heads.dflash) and its GGUF files in llama.cpp's dflash layout:
shapes and refusals, the non-causal block, closed-form checks of what the context K/V are, and
write → read round trips."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from head_oracles import DFlashHead, rope_neox

from edgespec.gguf_file import read_gguf
from edgespec.heads.dflash import DFlashConfig, random_tensors
from edgespec.heads.dflash_gguf import read_dflash_gguf, write_dflash_gguf
from edgespec.heads.numpy_ops import rms_norm, silu

V, VD, H, MASK = 100, 40, 64, 99
# Names llama.cpp 0.3.36 creates for a plain dflash head (src/models/dflash.cpp load_arch_tensors)
LLAMA_CPP_NAMES = {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "output.weight", "d2t"} | {
    f"blk.{i}.{n}.weight" for i in range(2) for n in (
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
        "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}


def _config(**kw) -> DFlashConfig:
    return DFlashConfig(**(dict(n_embd=H, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, target_layers=(2, 5, 7),
                                n_vocab=V, n_draft_vocab=VD, mask_token_id=MASK, block_size=8, rms_eps=1e-6,
                                rope_base=10000.0) | kw))


def _features(n: int, cfg: DFlashConfig, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, cfg.n_embd_enc)).astype(np.float32)


def test_shapes_and_config_refusals():
    cfg = _config()
    s = cfg.shapes()
    assert set(s) == LLAMA_CPP_NAMES
    assert s["fc.weight"] == (H, 3 * H) and s["output.weight"] == (VD, H) and s["blk.1.attn_k.weight"] == (32, H)
    assert s["blk.0.attn_q_norm.weight"] == (16,) and cfg.n_embd_enc == 192
    assert "output.weight" not in _config(n_draft_vocab=V).shapes(own_output=False)
    for bad in (dict(block_size=1), dict(mask_token_id=V), dict(n_draft_vocab=V + 1), dict(n_head_kv=3),
                dict(target_layers=()), dict(n_layer=0)):
        with pytest.raises(ValueError):
            _config(**bad)


def test_tensor_refusals():
    cfg = _config()
    t = random_tensors(cfg)
    for extra in ("blk.0.attn_conv_base", "markov_w1.weight", "blk.0.attn_sinks.weight", "fc.scale"):
        with pytest.raises(ValueError, match="unsupported DFlash tensors.*" + extra.replace(".", r"\.")):
            cfg.check_tensors(t | {extra: np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="lacks tensor blk.1.attn_v.weight"):
        cfg.check_tensors({k: v for k, v in t.items() if k != "blk.1.attn_v.weight"})
    with pytest.raises(ValueError, match="blk.0.attn_k_norm.weight has shape"):
        cfg.check_tensors(t | {"blk.0.attn_k_norm.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="needs its own output.weight"):
        cfg.check_tensors({k: v for k, v in t.items() if k != "output.weight"})
    with pytest.raises(ValueError, match="distinct target ids"):
        cfg.check_tensors(t | {"d2t": np.zeros(VD, np.int64)})
    with pytest.raises(ValueError, match="token embeddings"):
        DFlashHead(cfg, t)  # no own token_embd and none given


def test_block_outputs_and_errors():
    cfg = _config()
    d2t = np.sort(np.random.default_rng(1).choice(V, VD, replace=False))
    head = DFlashHead(cfg, random_tensors(cfg, d2t=d2t, own_embd=True))
    g = head.inject(_features(5, cfg))
    assert g.shape == (5, H) and head.n_past == 5
    assert head.block_tokens(3) == [3] + [MASK] * 7
    logits, h = head.forward_block(head.block_tokens(3))
    assert logits.shape == (8, V) and h.shape == (8, H) and head.n_past == 5  # the block is not cached
    assert np.isfinite(logits[:, d2t]).all() and np.isneginf(np.delete(logits, d2t, axis=1)).all()
    sub, _ = head.forward_block(head.block_tokens(3, 5))  # a 4-token draft runs a 5-token block
    assert sub.shape == (5, V)
    assert head.draft(3, 4) == [int(i) for i in sub[1:].argmax(axis=1)]
    assert set(head.draft(3)) <= set(d2t.tolist())
    for bad in ([], [3] * 9):
        with pytest.raises(ValueError, match="a block holds"):
            head.forward_block(bad)
    with pytest.raises(ValueError, match="target ids"):
        head.forward_block([V])
    with pytest.raises(ValueError, match="n_draft"):
        head.draft(3, 8)
    with pytest.raises(ValueError, match=r"features must be \(n, 192\)"):
        head.inject(np.zeros((2, H), np.float32))


def test_block_is_non_causal_unless_configured():
    """llama.cpp decodes the block with causal_attn = false (dflash.attention.causal): every block
    row sees every other, so a later token changes earlier rows; with causal = true it cannot."""
    for causal in (False, True):
        cfg = _config(causal=causal)
        head = DFlashHead(cfg, random_tensors(cfg, own_embd=True))
        head.inject(_features(4, cfg))
        a, _ = head.forward_block([3, MASK, MASK, MASK])
        b, _ = head.forward_block([3, MASK, MASK, 11])
        assert np.array_equal(a[:3] == b[:3], np.ones_like(a[:3], bool)) == causal
        assert not np.array_equal(a[3], b[3])


def test_context_cache_inject_in_chunks_and_truncate():
    cfg = _config()
    t = random_tensors(cfg, own_embd=True)
    f = _features(7, cfg)
    one, two = DFlashHead(cfg, t), DFlashHead(cfg, t)
    one.inject(f)
    two.inject(f[:3])
    two.inject(f[3:])
    np.testing.assert_array_equal(one.forward_block([5, MASK])[0], two.forward_block([5, MASK])[0])
    ref = DFlashHead(cfg, t)
    ref.inject(f[:4])
    before = ref.forward_block([5, MASK, MASK])[0]
    one.truncate(4)
    assert one.n_past == 4
    np.testing.assert_array_equal(one.forward_block([5, MASK, MASK])[0], before)
    assert not np.array_equal(two.forward_block([5, MASK, MASK])[0], before)  # positions and context matter


def test_closed_forms_pin_down_the_graph():
    """1 layer, wk = 0: every score is 0 (k_norm of zeros is zero), so attention is the mean of V
    over [context ; block], with context V = wv·g (g = hidden_norm(fc·f), no attn_norm, no V norm)
    and block V = wv·(RMSNorm(x)·attn_norm). Recomputed here by hand."""
    cfg = _config(n_layer=1, n_draft_vocab=V, embedding_scale=0.5, value_scale=2.0)
    rng = np.random.default_rng(5)
    t = random_tensors(cfg, own_embd=True)
    t = {k: (rng.uniform(0.5, 1.5, v.shape).astype(np.float32) if v.ndim == 1 else v) for k, v in t.items()}
    t["blk.0.attn_k.weight"] = np.zeros_like(t["blk.0.attn_k.weight"])
    head = DFlashHead(cfg, t)
    f = _features(3, cfg)
    g = head.inject(f)
    fc = (f.astype(np.float64) @ t["fc.weight"].T.astype(np.float64))
    np.testing.assert_allclose(g, rms_norm(fc.astype(np.float32), t["enc.output_norm.weight"], cfg.rms_eps), atol=1e-6)
    tokens = [4, MASK]
    logits, _ = head.forward_block(tokens)
    x = t["token_embd.weight"][tokens] * 0.5
    u = rms_norm(x, t["blk.0.attn_norm.weight"], cfg.rms_eps)
    v_all = np.concatenate([g, u]).astype(np.float64) @ t["blk.0.attn_v.weight"].T  # (5, 32)
    mean = np.repeat(v_all.mean(axis=0).reshape(2, 16), 2, axis=0).reshape(-1)  # GQA: q head h → kv h // 2
    r = x + 2.0 * (mean @ t["blk.0.attn_output.weight"].T)[None]
    y = rms_norm(r.astype(np.float32), t["blk.0.ffn_norm.weight"], cfg.rms_eps).astype(np.float64)
    ff = silu((y @ t["blk.0.ffn_gate.weight"].T).astype(np.float32)) * (y @ t["blk.0.ffn_up.weight"].T)
    out = ff @ t["blk.0.ffn_down.weight"].T + r
    want = rms_norm(out.astype(np.float32), t["output_norm.weight"], cfg.rms_eps) @ t["output.weight"].T
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)


def test_rope_neox_rotates_halves():
    x = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
    pos = np.array([0, 1, 7])
    y = rope_neox(x, pos, 6, 100.0)
    np.testing.assert_array_equal(y[0], x[0])
    np.testing.assert_array_equal(y[..., 6:], x[..., 6:])
    th = 7 * 100.0 ** (-2 * 1 / 6)  # pair (1, 4) at position 7
    np.testing.assert_allclose(y[2, :, 1], x[2, :, 1] * np.cos(th) - x[2, :, 4] * np.sin(th), rtol=1e-5)
    np.testing.assert_allclose(y[2, :, 4], x[2, :, 1] * np.sin(th) + x[2, :, 4] * np.cos(th), rtol=1e-5)


@pytest.mark.parametrize("own_embd", [False, True])
def test_f32_round_trip_is_exact_and_keys_are_llama_cpps(tmp_path: Path, vocab100: Path, own_embd: bool):
    cfg = _config(causal=own_embd, attention_scale=0.125 if own_embd else 0.0)
    t = random_tensors(cfg, seed=2, own_embd=own_embd)
    path = write_dflash_gguf(tmp_path / "h.gguf", cfg, t, vocab_source=vocab100, weight_type="f32")
    cfg2, t2 = read_dflash_gguf(path)
    assert cfg2 == cfg and set(t2) == set(t)
    for k in t:
        assert t2[k].dtype == (np.int64 if k == "d2t" else np.float32)
        np.testing.assert_array_equal(t2[k], t[k])
    f = read_gguf(path, lambda k: True, with_tensors=False)
    assert f.value("general.architecture") == "dflash"
    assert f.value("dflash.target_layers") == [2, 5, 7] and f.kv["dflash.target_layers"][2] == gguf.GGUFValueType.INT32
    assert f.value("dflash.block_size") == 8 and f.kv["dflash.block_size"][1] == gguf.GGUFValueType.UINT32
    assert f.value("tokenizer.ggml.mask_token_id") == MASK and f.value("dflash.attention.causal") is own_embd
    assert f.value("dflash.block_count") == 2 and f.value("dflash.attention.key_length") == 16
    assert ("dflash.attention.scale" in f.kv) is own_embd and "dflash.embedding_scale" not in f.kv


def test_f16_and_q8_0_round_trips(tmp_path: Path, vocab100: Path):
    cfg = _config()
    t = random_tensors(cfg, seed=3)
    _, t16 = read_dflash_gguf(write_dflash_gguf(tmp_path / "16.gguf", cfg, t, vocab_source=vocab100))
    _, t8 = read_dflash_gguf(write_dflash_gguf(tmp_path / "8.gguf", cfg, t, vocab_source=vocab100,
                                               weight_type="q8_0"))
    for k, v in t.items():
        exact = v.ndim == 1 or k == "fc.weight"  # norms, d2t and fc (F32_TENSORS) stay exact
        want16 = v if exact else v.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(t16[k], want16)
        if v.ndim == 2:
            np.testing.assert_allclose(t8[k], v, atol=0 if exact else np.abs(v).max() / 127 + 1e-6)
    embd = np.random.default_rng(4).standard_normal((V, H)).astype(np.float32)
    head, head16 = DFlashHead(cfg, t, tok_embd=embd), DFlashHead(cfg, t16, tok_embd=embd)
    for hd in (head, head16):
        hd.inject(_features(4, cfg))
    a, b = head.forward_block([1, MASK, MASK])[0], head16.forward_block([1, MASK, MASK])[0]
    np.testing.assert_allclose(b[:, :VD], a[:, :VD], atol=2e-2)  # the F16 head drafts like the F32 one


def test_gguf_refusals(tmp_path: Path, vocab100: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = _config()
    t = random_tensors(cfg)
    with pytest.raises(ValueError, match="weight_type"):
        write_dflash_gguf(tmp_path / "x.gguf", cfg, t, vocab_source=vocab100, weight_type="q4_0")
    with pytest.raises(ValueError, match="has 100 tokens"):
        write_dflash_gguf(tmp_path / "x.gguf", _config(n_vocab=200), random_tensors(_config(n_vocab=200)),
                          vocab_source=vocab100)
    with pytest.raises(ValueError, match="not a DFlash head"):
        read_dflash_gguf(vocab100)
    sel = write_dflash_gguf(tmp_path / "sel.gguf", cfg, t, vocab_source=vocab100,
                            extra_kv={"dflash.selector_rank": "8"})
    with pytest.raises(ValueError, match="dflash.selector_rank"):
        read_dflash_gguf(sel)
    monkeypatch.setattr(DFlashConfig, "check_tensors", lambda self, tensors: None)
    sinks = write_dflash_gguf(tmp_path / "sinks.gguf", cfg, t | {"blk.0.attn_sinks.weight": np.ones(4, np.float32)},
                              vocab_source=vocab100)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"unsupported DFlash tensors.*blk\.0\.attn_sinks\.weight"):
        read_dflash_gguf(sinks)
