"""The MLX backend on tiny mlx-lm models (no model files): rollback, row selection, refusal of
untrimmable caches, the GGUF block → MLX affine repacking, GGUF tensor names, the missing-extra error."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from mlx_fixtures import build_tiny_mlx

mx = pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

from edgespec.backends.mlx import MlxBackend  # noqa: E402
from edgespec.backends.mlx_convert import _AFFINE, affine_from_blocks, mlx_name  # noqa: E402
from edgespec.backends.reference import ReferenceBackend  # noqa: E402
from edgespec.errors import ContextOverflowError, MissingDependencyError, ModelLoadError  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_mlx(tmp_path_factory.mktemp("mlx") / "tiny", seed=0)


def _open(path, **kw) -> MlxBackend:
    return MlxBackend(path, vocab=ReferenceBackend(6), **kw)


def test_rows_and_rollback_match_a_fresh_evaluation(tiny_dir):
    """Trimming the cache and evaluating other tokens gives the logits of a fresh evaluation."""
    b, fresh = _open(tiny_dir), _open(tiny_dir)
    assert b.eval([0, 1, 2, 3, 4], rows="none").shape == (0, 6)
    assert b.n_past == 5
    b.truncate(2)
    assert b.n_past == 2 and all(c.offset == 2 for c in b._caches)
    got = b.eval([5, 1, 3], rows="all")  # (3, V)
    want = fresh.eval([0, 1, 5, 1, 3], rows="all")[2:]
    assert got.shape == (3, 6) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    last = b.eval([2], rows="last")
    assert last.shape == (1, 6)
    np.testing.assert_allclose(last[0], fresh.eval([2], rows="all")[0], rtol=1e-5, atol=1e-5)
    b.truncate(0)
    np.testing.assert_allclose(b.eval([0, 1], rows="all"), _open(tiny_dir).eval([0, 1], rows="all"),
                               rtol=1e-5, atol=1e-5)


def test_long_prompts_are_chunked_and_the_context_is_enforced(tiny_dir):
    b, whole = _open(tiny_dir, n_batch=4, n_ctx=16), _open(tiny_dir)
    ids = [i % 6 for i in range(11)]
    np.testing.assert_allclose(b.eval(ids, rows="all"), whole.eval(ids, rows="all"), rtol=1e-5, atol=1e-5)
    with pytest.raises(ContextOverflowError):
        b.eval([0] * 6)
    assert b.n_past == 11  # nothing evaluated


def test_untrimmable_cache_is_refused_naming_the_layer_type(tmp_path):
    """Recurrent caches are checkpointed (test_recurrent_mlx.py); a sliding window inside a CacheList is not."""
    path = build_tiny_mlx(tmp_path / "baichuan", model_type="baichuan_m1")
    with pytest.raises(ModelLoadError, match=r"'baichuan_m1'.*layer 0 keeps a RotatingKVCache.*neither be trimmed"):
        _open(path)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        _open(tmp_path)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K"])
def test_block_repacking_matches_the_gguf_dequantizer(kind):
    """GGUF block formats → MLX affine group 32 are exact (float32 scales): MLX's dequantization of
    the repacked arrays equals `gguf`'s own dequantizer on random blocks."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(0)
    n_rows, n_cols = 3, 512
    size, bits = _AFFINE[kind]
    per_block = 256 if kind.endswith("_K") else 32  # values per block
    blocks = rng.integers(0, 256, (n_rows * n_cols // per_block, size), dtype=np.uint8)
    for lo, hi, col in ((1e-3, 2e-2, 0), (1e-4, 1e-2, 2)):  # d, then dmin/m where the format has one
        if col == 0 or kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):
            blocks[:, col:col + 2] = rng.uniform(lo, hi, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    want = quants.dequantize(blocks, getattr(GGMLQuantizationType, kind)).reshape(n_rows, n_cols)
    w, s, b = affine_from_blocks(blocks, kind, n_rows)
    assert w.shape == (n_rows, n_cols * bits // 32) and s.shape == b.shape == (n_rows, n_cols // 32)
    got = np.array(mx.dequantize(mx.array(w), mx.array(s), mx.array(b), group_size=32, bits=bits))
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


# GGUF tensor → mlx-lm parameter, per architecture (recurrent ones included: Mamba-2, LFM2)
MLX_NAMES = [("blk.3.attn_q.weight", "llama", "model.layers.3.self_attn.q_proj.weight"),
             ("blk.0.ffn_norm.weight", "llama", "model.layers.0.post_attention_layernorm.weight"),
             ("blk.0.ffn_norm.weight", "gemma3", "model.layers.0.pre_feedforward_layernorm.weight"),
             ("blk.2.post_ffw_norm.weight", "gemma3", "model.layers.2.post_feedforward_layernorm.weight"),
             ("token_embd.weight", "gemma3", "model.embed_tokens.weight"), ("output.weight", "llama", "lm_head.weight"),
             ("blk.1.ssm_a", "mamba2", "backbone.layers.1.mixer.A_log"),
             ("blk.0.ssm_dt.bias", "mamba2", "backbone.layers.0.mixer.dt_bias"),
             ("blk.0.ssm_conv1d.weight", "mamba2", "backbone.layers.0.mixer.conv1d.weight"),
             ("output_norm.weight", "mamba2", "backbone.norm_f.weight"),
             ("blk.2.shortconv.conv.weight", "lfm2", "model.layers.2.conv.conv.weight"),
             ("blk.1.attn_output.weight", "lfm2", "model.layers.1.self_attn.out_proj.weight"),
             ("token_embd_norm.weight", "lfm2", "model.embedding_norm.weight")]


@pytest.mark.parametrize("gguf_name, arch, want", MLX_NAMES)
def test_gguf_tensor_names(gguf_name, arch, want):
    assert mlx_name(gguf_name, arch) == want


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_unknown_tensor_names_are_refused(arch):
    with pytest.raises(ModelLoadError, match=f"unknown {arch} tensor 'blk.0.ssm_a'"):
        mlx_name("blk.0.ssm_a", arch)


def test_missing_mlx_is_one_line_naming_the_extra(monkeypatch):
    from edgespec.backends.deps import import_mlx

    monkeypatch.setitem(sys.modules, "mlx.core", None)  # `import mlx.core` now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'edgespec\[mlx\]'") as err:
        import_mlx()
    assert "\n" not in str(err.value)
