"""EAGLE-3 heads as GGUF in llama.cpp's eagle3 layout: write → read round trips, the exact keys and
tensor names the vendored llama.cpp reads, and libllama loading what edgespec writes."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgespec.gguf_file import read_gguf
from edgespec.heads.eagle3 import Eagle3Config, random_tensors
from edgespec.heads.gguf_io import read_eagle3_gguf, write_eagle3_gguf

V, VD, H = 100, 40, 64
# Names llama.cpp 0.3.36 creates for eagle3 (src/models/eagle3.cpp load_arch_tensors + llama-arch.cpp)
LLAMA_CPP_NAMES = {"d2t", "fc.weight", "output_norm.weight", "output.weight"} | {
    f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "attn_q", "attn_k", "attn_v", "attn_output",
                                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}


def _config(**kw) -> Eagle3Config:
    return Eagle3Config(**(dict(n_embd=H, n_head=4, n_head_kv=2, n_ff=96, n_embd_tgt=64,
                                target_layers=(2, 9, 15), n_vocab=V, n_draft_vocab=VD, rms_eps=1e-6,
                                rope_base=100000.0, context_length=4096) | kw))


def _tensors(cfg: Eagle3Config) -> dict[str, np.ndarray]:
    d2t = np.sort(np.random.default_rng(7).choice(cfg.n_vocab, cfg.n_draft_vocab, replace=False))
    t = random_tensors(cfg, seed=3, d2t=d2t)
    for name in ("blk.0.attn_norm.weight", "output_norm.weight"):
        t[name] = np.linspace(0.5, 1.5, cfg.n_embd, dtype=np.float32)
    return t


def test_f16_round_trip_is_exact(tmp_path: Path, vocab100: Path):
    cfg, t = _config(), _tensors(_config())
    cfg2, t2 = read_eagle3_gguf(write_eagle3_gguf(tmp_path / "h.gguf", cfg, t, vocab_source=vocab100))
    assert cfg2 == cfg
    assert set(t2) == set(t)
    for name, arr in t.items():
        want = arr if name == "d2t" or arr.ndim == 1 else arr.astype(np.float16).astype(np.float32)
        assert t2[name].dtype == (np.int64 if name == "d2t" else np.float32)
        np.testing.assert_array_equal(t2[name], want, err_msg=name)


def test_q8_0_round_trip_within_quantization_error(tmp_path: Path, vocab100: Path):
    cfg, t = _config(), _tensors(_config())
    path = write_eagle3_gguf(tmp_path / "h.gguf", cfg, t, vocab_source=vocab100, weight_type="q8_0")
    _, t2 = read_eagle3_gguf(path)
    types = {n: q for n, (q, _s, _r) in read_gguf(path).tensors.items()}
    for name, arr in t.items():
        if name == "d2t" or arr.ndim == 1:
            np.testing.assert_array_equal(t2[name], arr)
            continue
        assert types[name] == gguf.GGMLQuantizationType.Q8_0
        blocks = arr.reshape(-1, 32)  # Q8_0: per 32 values, d = max|x| / 127 (fp16), q = round(x / d)
        err = np.abs(t2[name].reshape(-1, 32) - blocks)
        bound = 0.5 * np.abs(blocks).max(axis=1, keepdims=True) / 127 * (1 + 127 * 2.0**-10)
        assert (err <= bound + 1e-7).all(), name
        assert err.max() > 0


def test_q8_0_rows_that_do_not_block_fall_back_to_f16(tmp_path: Path, vocab100: Path):
    cfg = _config(n_ff=40)  # ffn_down rows have 40 values: not a multiple of 32
    path = write_eagle3_gguf(tmp_path / "h.gguf", cfg, _tensors(cfg), vocab_source=vocab100, weight_type="q8_0")
    types = {n: q for n, (q, _s, _r) in read_gguf(path).tensors.items()}
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_keys_and_names_are_llama_cpps(tmp_path: Path, vocab100: Path):
    cfg = _config()
    path = write_eagle3_gguf(tmp_path / "h.gguf", cfg, _tensors(cfg), vocab_source=vocab100,
                             extra_kv={"edgespec.head.seed": "3"})
    f = read_gguf(path)
    assert f.value("general.architecture") == "eagle3"
    layers, vtype, sub = f.kv["eagle3.target_layers"]
    assert (layers, vtype, sub) == ([2, 9, 15], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    assert f.kv["eagle3.target_hidden_size"][:2] == (64, gguf.GGUFValueType.UINT32)
    assert f.value("eagle3.norm_before_residual") is False and f.value("eagle3.norm_before_fc") is False
    for key, want in {"eagle3.embedding_length": H, "eagle3.block_count": 1, "eagle3.feed_forward_length": 96,
                      "eagle3.attention.head_count": 4, "eagle3.attention.head_count_kv": 2,
                      "eagle3.context_length": 4096, "eagle3.rope.dimension_count": 16,
                      "eagle3.vocab_size": V, "edgespec.head.seed": "3"}.items():
        assert f.value(key) == want, key
    assert f.value("eagle3.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    assert f.value("eagle3.rope.freq_base") == pytest.approx(1e5)
    assert len(f.value("tokenizer.ggml.tokens")) == V
    assert set(f.tensors) == LLAMA_CPP_NAMES
    assert f.tensors["d2t"][:2] == (gguf.GGMLQuantizationType.I64, (VD,))
    assert f.tensors["fc.weight"][1] == (H, 3 * 64)  # GGUF ne = {3·H_t, H}
    assert f.tensors["blk.0.attn_q.weight"][1] == (H, 2 * H)  # ne = {2H, n_head·head_dim}


def test_bad_heads_are_refused(tmp_path: Path, vocab100: Path):
    cfg = _config()
    t = _tensors(cfg)
    with pytest.raises(ValueError, match="lacks tensor output.weight"):
        write_eagle3_gguf(tmp_path / "h.gguf", cfg, {k: v for k, v in t.items() if k != "output.weight"},
                          vocab_source=vocab100)
    with pytest.raises(ValueError, match="has 100 tokens"):
        write_eagle3_gguf(tmp_path / "h.gguf", _config(n_vocab=120), t, vocab_source=vocab100)
    with pytest.raises(ValueError, match="weight_type"):
        write_eagle3_gguf(tmp_path / "h.gguf", cfg, t, vocab_source=vocab100, weight_type="q4_0")
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        read_eagle3_gguf(vocab100)


@pytest.mark.real
@pytest.mark.parametrize("weight_type", ["f16", "q8_0"])
def test_libllama_loads_what_edgespec_writes(tmp_path: Path, smollm2_path: Path, weight_type: str):
    """llama.cpp 0.3.36 loads an edgespec head for SmolLM2 standalone (model != NULL, its target
    layers read back through llama_model_target_layer_ids); a context for it needs ctx_other (the
    head borrows the target's token embeddings), and with the target's context it is created."""
    from edgespec.backends import llama_cpp as lc
    from edgespec.backends.deps import import_llama
    from edgespec.backends.llama_features import ext_api

    cfg = Eagle3Config(n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_embd_tgt=576, target_layers=(2, 15, 27),
                       n_vocab=49152, n_draft_vocab=4096)
    d2t = np.sort(np.random.default_rng(0).choice(49152, 4096, replace=False))
    path = write_eagle3_gguf(tmp_path / "h.gguf", cfg, random_tensors(cfg, d2t=d2t), vocab_source=smollm2_path,
                             weight_type=weight_type)
    ll = import_llama()
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    assert model, lc.load_failure_reason(path)
    try:
        assert ext_api().model_target_layers(model) == (2, 15, 27)
        assert ll.llama_model_n_embd(model) == 576 and ll.llama_model_n_layer(model) == 1
        assert ll.llama_model_has_encoder(model)
        cp = ll.llama_context_default_params()
        cp.n_ctx = 64
        assert not ll.llama_init_from_model(model, cp)  # "eagle3 requires ctx_other to be set"
        with lc.LlamaCppBackend(smollm2_path, n_ctx=64, threads=1) as target:
            cp.ctx_other = target.llama_context
            ctx = ll.llama_init_from_model(model, cp)
            assert ctx
            ll.llama_free(ctx)
    finally:
        ll.llama_model_free(model)
