"""libllama 0.3.36 loads the DFlash GGUFs edgespec writes and its dflash graph computes what the
numpy reference computes, driven as common/speculative.cpp drives it (edgespec.heads.dflash_llama):
an embd batch of fused target features at their positions (KV injection), then a token batch
[anchor, MASK…] after them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from head_oracles import DFlashHead

from edgespec.errors import ModelLoadError
from edgespec.gguf_file import read_gguf
from edgespec.heads.dflash import DFlashConfig, random_tensors
from edgespec.heads.dflash_gguf import read_dflash_gguf, write_dflash_gguf
from edgespec.heads.dflash_llama import LlamaDFlashHead

pytestmark = pytest.mark.real

V = 49152  # SmolLM2's tokenizer, copied into the head


def _config(**kw: Any) -> DFlashConfig:
    return DFlashConfig(**(dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, target_layers=(2, 4, 5),
                                n_vocab=V, n_draft_vocab=1000, mask_token_id=V - 1, block_size=8,
                                rope_base=10000.0) | kw))


def _finite_close(a: np.ndarray, b: np.ndarray, atol: float) -> float:
    assert np.array_equal(np.isfinite(a), np.isfinite(b))
    diff = float(np.abs(a[np.isfinite(a)] - b[np.isfinite(b)]).max())
    assert diff <= atol, diff
    return diff


@pytest.mark.parametrize(("exact", "causal"), [(True, False), (False, False), (True, True)])
def test_libllama_dflash_graph_equals_numpy(tmp_path: Path, smollm2_path: Path, exact: bool, causal: bool):
    """Prefill 6 feature rows, a full block at 6; reject: 2 more rows, a 5-token block at 8.
    exact: F32 weights, attention and KV (measured 7e-7); else F16 weights, flash attention and an
    F16 KV cache, llama.cpp's defaults (measured 2.6e-3 on logits of magnitude ≤ 4). causal:
    dflash.attention.causal = true, which the context takes as its default mask."""
    cfg = _config(causal=causal)
    d2t = np.sort(np.random.default_rng(3).choice(V, 1000, replace=False))
    path = write_dflash_gguf(tmp_path / "h.gguf", cfg, random_tensors(cfg, seed=1, d2t=d2t, own_embd=True),
                             vocab_source=smollm2_path, weight_type="f32" if exact else "f16")
    ref = DFlashHead(*read_dflash_gguf(path))
    feats = np.random.default_rng(0).standard_normal((8, cfg.n_embd_enc)).astype(np.float32)
    # a standalone context: the head has its own token_embd and output, so no ctx_other
    head = LlamaDFlashHead(path, n_ctx=64, n_batch=64, flash_attn=not exact, kv_type="f32" if exact else "f16",
                           threads=1)
    try:
        assert head.target_layers == (2, 4, 5) and head.n_embd == 64 and head.n_vocab == V
        assert (head.block_size, head.mask_token_id) == (8, V - 1)
        assert head._ll.llama_model_n_layer(head._model) == 2
        atol = 1e-5 if exact else 1e-2
        head.inject(feats[:6])
        ref.inject(feats[:6])
        toks = ref.block_tokens(17)
        assert head.block_tokens(17) == toks
        got, (want, _) = head.block_logits(toks), ref.forward_block(toks)
        _finite_close(got, want, atol)
        assert head.n_past == 6  # the block's K/V were dropped
        head.inject(feats[6:])
        ref.inject(feats[6:])
        toks = ref.block_tokens(int(d2t[5]), 5)
        got, (want, _) = head.block_logits(toks), ref.forward_block(toks)
        _finite_close(got, want, atol)
        if exact:
            assert list(got[1:].argmax(axis=1)) == ref.draft(int(d2t[5]), 4) == head.draft(int(d2t[5]), 4)
        head.truncate(3)  # a rejection: re-inject from position 3
        ref.truncate(3)
        head.inject(feats[3:7])
        ref.inject(feats[3:7])
        toks = ref.block_tokens(5, 3)
        _finite_close(head.block_logits(toks), ref.block_logits(toks), atol)
    finally:
        head.close()


def test_head_without_embeddings_needs_a_target_context(tmp_path: Path, smollm2_path: Path):
    """A head that borrows the target's token_embd/output loads, but llama.cpp refuses a context
    for it unless ctx_other is set (as for eagle3): LlamaDFlashHead without a target says so."""
    cfg = _config(n_draft_vocab=V)
    t = {k: v for k, v in random_tensors(cfg).items() if k != "output.weight"}
    path = write_dflash_gguf(tmp_path / "bare.gguf", cfg, t, vocab_source=smollm2_path, weight_type="f32")
    with pytest.raises(ModelLoadError, match="cannot create a llama.cpp context for the DFlash head"):
        LlamaDFlashHead(path, n_ctx=64, threads=1)


def test_features_beyond_float16_range_stay_finite(tmp_path: Path, smollm2_path: Path):
    """Real residual streams have outlier dimensions beyond float16's range (Gemma-3-270M: ~1e5). With
    llama.cpp's default F16 weights and flash attention, fc is still written F32, so such features
    give finite logits equal to numpy's (an F16 fc turned them into NaN)."""
    cfg = _config()
    path = write_dflash_gguf(tmp_path / "h.gguf", cfg, random_tensors(cfg, seed=1, own_embd=True),
                             vocab_source=smollm2_path, weight_type="f16")
    feats = np.random.default_rng(0).standard_normal((6, cfg.n_embd_enc)).astype(np.float32)
    feats[:, ::17] *= 1e5  # outlier dimensions, as in a real residual stream
    ref = DFlashHead(*read_dflash_gguf(path))
    head = LlamaDFlashHead(path, n_ctx=64, n_batch=64, threads=1)
    try:
        head.inject(feats)
        ref.inject(feats)
        toks = ref.block_tokens(17)
        _finite_close(head.block_logits(toks), ref.block_logits(toks), 1e-2)
    finally:
        head.close()
    assert read_gguf(path).tensors["fc.weight"][0] == gguf.GGMLQuantizationType.F32
