"""DSpark's Markov and confidence heads (edgespec.heads.dspark) against a hand computation, their
config and tensor checks, and GGUF round trips in llama.cpp's layout (dflash + markov/conf tensors)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from head_oracles import DFlashHead
from test_dflash_head import MASK, VD, V, _config

from edgespec.gguf_file import read_gguf
from edgespec.heads.dflash import random_tensors
from edgespec.heads.dflash_gguf import read_dflash_gguf, write_dflash_gguf
from edgespec.heads.dspark import MarkovHead

R = 4


def _dspark(**kw):
    cfg = _config(markov_rank=R, has_confidence=True, **kw)
    return cfg, random_tensors(cfg, seed=5, d2t=np.arange(V - VD, V))


def test_config_shapes_and_refusals():
    cfg, t = _dspark()
    s = cfg.shapes()
    assert s["markov_w1.weight"] == (V, R) and s["markov_w2.weight"] == (VD, R)
    assert s["conf_proj.weight"] == (1, 64 + R) and s["conf_proj.bias"] == (1,) and cfg.kind == "DSpark"
    cfg.check_tensors(t)
    assert "conf_proj.weight" not in _config(markov_rank=R).shapes()
    with pytest.raises(ValueError, match="confidence head needs a Markov head"):
        _config(has_confidence=True)
    with pytest.raises(ValueError, match="sample_from_anchor"):
        _config(markov_rank=R, sample_from_anchor=True)
    with pytest.raises(ValueError, match=r"unsupported DFlash tensors.*markov_w2\.scale"):
        cfg.check_tensors(t | {"markov_w2.scale": np.ones(1, np.float32)})
    with pytest.raises(ValueError, match="lacks tensor conf_proj.bias"):
        cfg.check_tensors({k: v for k, v in t.items() if k != "conf_proj.bias"})


def test_markov_bias_and_confidence_by_hand():
    """A d2t mapping draft rows to target ids 60..99: the bias of prev lands on those ids only."""
    cfg, t = _dspark()
    m = MarkovHead(cfg, t)
    prev = 17
    w1, w2, cw, cb = t["markov_w1.weight"], t["markov_w2.weight"], t["conf_proj.weight"], t["conf_proj.bias"]
    want = [sum(float(w2[j, k]) * float(w1[prev, k]) for k in range(R)) for j in range(VD)]
    np.testing.assert_allclose(m.bias(prev), want, rtol=1e-6, atol=1e-6)
    z = np.full(V, -np.inf, np.float32)
    z[V - VD:] = np.arange(VD, dtype=np.float32)
    out = m.apply(z, prev)
    assert np.isneginf(out[:V - VD]).all()
    np.testing.assert_allclose(out[V - VD:], np.arange(VD) + np.asarray(want), rtol=1e-6, atol=1e-6)
    # a row carrying another token's bias: swapped for prev's in one pass; the row itself when equal
    swapped = m.apply(m.apply(z, 5), prev, old=5)
    np.testing.assert_allclose(swapped[V - VD:], out[V - VD:], rtol=1e-6, atol=1e-5)
    assert np.isneginf(swapped[:V - VD]).all()
    assert m.apply(out, prev, old=prev) is out
    h = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    x = sum(float(cw[0, i]) * float(h[i]) for i in range(64)) + sum(
        float(cw[0, 64 + k]) * float(w1[prev, k]) for k in range(R)) + float(cb[0])
    assert m.confidence(h, prev) == pytest.approx(1 / (1 + np.exp(-x)), rel=1e-6)
    assert MarkovHead(_config(markov_rank=R), random_tensors(_config(markov_rank=R))).confidence(h, prev) is None
    with pytest.raises(ValueError, match="no Markov head"):
        MarkovHead(_config(), random_tensors(_config()))


def test_dspark_head_runs_as_a_dflash_head():
    """The DFlash backbone ignores the Markov tensors: same block logits as without them."""
    cfg, t = _dspark()
    plain = {k: v for k, v in t.items() if not k.startswith(("markov", "conf"))}
    embd = np.random.default_rng(4).standard_normal((V, 64)).astype(np.float32)
    a, b = DFlashHead(cfg, t, tok_embd=embd), DFlashHead(_config(), plain, tok_embd=embd)
    np.testing.assert_array_equal(a.forward_block([1, MASK, MASK])[0], b.forward_block([1, MASK, MASK])[0])


Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize(("weight_type", "markov_type", "rank", "w1_type"),
                         [("f32", "f32", R, Q.F32), ("q8_0", "q8_0", R, Q.F16), ("f16", None, 32, Q.Q8_0),
                          ("f32", "f16", 32, Q.F16)])
def test_gguf_round_trip(tmp_path: Path, vocab100: Path, weight_type: str, markov_type: str | None,  # noqa: F811
                         rank: int, w1_type: gguf.GGMLQuantizationType):
    """markov_w2 and the confidence head stay F32 (exact) whatever the weight type; markov_w1 is
    written in ``markov_type`` (default Q8_0 outside F32 files; F16 when Q8_0 cannot block its rows)
    and reads back as exactly the dequantized values ggml's get_rows gives; ne orders and keys are
    llama.cpp's."""
    cfg = _config(markov_rank=rank, has_confidence=True)
    t = random_tensors(cfg, seed=5, d2t=np.arange(V - VD, V))
    path = write_dflash_gguf(tmp_path / "s.gguf", cfg, t, vocab_source=vocab100, weight_type=weight_type,
                             markov_type=markov_type)
    cfg2, t2 = read_dflash_gguf(path)
    assert cfg2 == cfg and set(t2) == set(t)
    for k in ("markov_w2.weight", "conf_proj.weight", "conf_proj.bias"):
        np.testing.assert_array_equal(t2[k], t[k])
    w1 = t["markov_w1.weight"]
    np.testing.assert_array_equal(t2["markov_w1.weight"],
                                  gguf.quants.dequantize(gguf.quants.quantize(w1, w1_type), w1_type).reshape(w1.shape))
    if w1_type != Q.F32:
        assert 0 < np.abs(t2["markov_w1.weight"] - w1).max() <= 0.01 * np.abs(w1).max()
    f = read_gguf(path, lambda k: True)
    assert f.value("dflash.sample_from_anchor") is False and f.value("dflash.has_confidence_head") is True
    assert f.kv["dflash.sample_from_anchor"][1] == gguf.GGUFValueType.BOOL
    r = gguf.GGUFReader(path)
    ne = {x.name: (tuple(int(n) for n in x.shape), x.tensor_type) for x in r.tensors}
    assert ne["markov_w1.weight"] == ((rank, V), w1_type) and ne["markov_w2.weight"] == ((rank, VD), Q.F32)
    assert ne["conf_proj.weight"] == ((64 + rank, 1), Q.F32) and ne["conf_proj.bias"] == ((1,), Q.F32)
    cfg3, t3 = _config(markov_rank=R), random_tensors(_config(markov_rank=R))
    cfg4, _ = read_dflash_gguf(write_dflash_gguf(tmp_path / "nc.gguf", cfg3, t3, vocab_source=vocab100))
    assert cfg4 == cfg3 and not cfg4.has_confidence


def test_gguf_refuses_an_unknown_markov_type(tmp_path: Path, vocab100: Path):  # noqa: F811
    cfg, t = _dspark()
    with pytest.raises(ValueError, match="markov_type must be one of f32, f16, q8_0 .got 'q4_0'."):
        write_dflash_gguf(tmp_path / "x.gguf", cfg, t, vocab_source=vocab100, markov_type="q4_0")


def test_gguf_refuses_sample_from_anchor(tmp_path: Path, vocab100: Path):  # noqa: F811
    cfg, t = _dspark()
    for extra in ({"dflash.sample_from_anchor": True}, None):
        path = tmp_path / "a.gguf"
        write_dflash_gguf(path, cfg, t, vocab_source=vocab100)
        _rewrite_key(path, extra)
        with pytest.raises(ValueError, match="dflash.sample_from_anchor = true"):
            read_dflash_gguf(path)


def _rewrite_key(path: Path, value: dict | None) -> None:
    """Copy `path` with dflash.sample_from_anchor set to `value`'s (None: removed)."""
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(path.with_suffix(".tmp"), "dflash")
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "dflash.sample_from_anchor"):
            continue
        vt = field.types[0]
        sub = field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vt, sub)
    if value:
        w.add_bool("dflash.sample_from_anchor", value["dflash.sample_from_anchor"])
    for x in r.tensors:
        w.add_tensor(x.name, np.asarray(x.data), raw_shape=tuple(reversed([int(n) for n in x.shape])),
                     raw_dtype=x.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path.with_suffix(".tmp").replace(path)
