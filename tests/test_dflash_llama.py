"""libllama 0.3.36 loads the DFlash GGUFs edgespec writes and its dflash graph computes what the
numpy reference computes, driven as common/speculative.cpp drives it: an embd batch of fused target
features at their positions (KV injection), then a token batch [anchor, MASK…] after them."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgespec.backends import llama_cpp as lc
from edgespec.backends.llama_features import ext_api
from edgespec.heads.dflash import DFlashConfig, DFlashHead, random_tensors
from edgespec.heads.dflash_gguf import read_dflash_gguf, write_dflash_gguf

pytestmark = pytest.mark.real

V = 49152  # SmolLM2's tokenizer, copied into the head
_DECODE = 1  # enum llama_process_type


def _config(**kw: Any) -> DFlashConfig:
    return DFlashConfig(**(dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, target_layers=(2, 4, 5),
                                n_vocab=V, n_draft_vocab=1000, mask_token_id=V - 1, block_size=8,
                                rope_base=10000.0) | kw))


class _LlamaDFlash:
    """A standalone dflash context (the head has its own token_embd and output, so no ctx_other)."""

    def __init__(self, path: Path, flash_attn: bool, kv_type: str) -> None:
        self.ll = ll = lc._lib()
        self.model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
        assert self.model, lc._diagnose(path)
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 64, 64, 64, 1
        cp.n_threads = cp.n_threads_batch = 1
        cp.type_k = cp.type_v = lc._KV_TYPES[kv_type]
        cp.flash_attn_type = -1 if flash_attn else 0
        cp.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.batch = ll.llama_batch_ext_init(self.ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))

    def inject(self, features: np.ndarray, pos0: int) -> None:
        ll, rows = self.ll, [np.ascontiguousarray(r, np.float32) for r in features]
        ll.llama_batch_ext_clear(self.batch)
        for i, row in enumerate(rows):
            e = ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[0])
            idx = ll.llama_batch_ext_add_embd(self.batch, 0, e)
            p = pos0 + i
            assert idx >= 0 and ll.llama_batch_ext_set_pos(self.batch, idx, (ll.llama_pos * 4)(p, p, p, 0))
        assert ll.llama_process(self.ctx, _DECODE, self.batch) == 0

    def block(self, tokens: Sequence[int], pos0: int) -> np.ndarray:
        ll = self.ll
        ll.llama_batch_ext_clear(self.batch)
        for i, tok in enumerate(tokens):
            idx = ll.llama_batch_ext_add_token(self.batch, 0, int(tok))
            p = pos0 + i
            assert idx >= 0 and ll.llama_batch_ext_set_pos(self.batch, idx, (ll.llama_pos * 4)(p, p, p, 0))
            ll.llama_batch_ext_set_output_logits(self.batch, idx, True)
        assert ll.llama_process(self.ctx, _DECODE, self.batch) == 0
        out = np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                        for i in range(len(tokens))]).copy()
        # speculative.cpp drops the block's K/V before the accepted tokens' features go in
        assert ll.llama_memory_seq_rm(ll.llama_get_memory(self.ctx), 0, pos0, -1)
        return out

    def close(self) -> None:
        self.ll.llama_batch_ext_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


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
    head = _LlamaDFlash(path, flash_attn=not exact, kv_type="f32" if exact else "f16")
    try:
        assert ext_api().model_target_layers(head.model) == (2, 4, 5)
        assert head.ll.llama_model_n_embd(head.model) == 64 and head.ll.llama_model_n_layer(head.model) == 2
        atol = 1e-5 if exact else 1e-2
        head.inject(feats[:6], 0)
        ref.inject(feats[:6])
        toks = ref.block_tokens(17)
        got, (want, _) = head.block(toks, 6), ref.forward_block(toks)
        _finite_close(got, want, atol)
        head.inject(feats[6:], 6)
        ref.inject(feats[6:])
        toks = ref.block_tokens(int(d2t[5]), 5)
        got, (want, _) = head.block(toks, 8), ref.forward_block(toks)
        _finite_close(got, want, atol)
        if exact:
            assert list(got[1:].argmax(axis=1)) == ref.draft(int(d2t[5]), 4)
    finally:
        head.close()


def test_head_without_embeddings_needs_a_target_context(tmp_path: Path, smollm2_path: Path):
    """A head that borrows the target's token_embd/output loads, but llama.cpp refuses a context
    for it unless ctx_other is set (as for eagle3)."""
    cfg = _config(n_draft_vocab=V)
    t = {k: v for k, v in random_tensors(cfg).items() if k != "output.weight"}
    path = write_dflash_gguf(tmp_path / "bare.gguf", cfg, t, vocab_source=smollm2_path, weight_type="f32")
    ll = lc._lib()
    model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
    assert model, lc._diagnose(path)
    try:
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch = 64, 1, 1
        assert not ll.llama_init_from_model(model, cp)
    finally:
        ll.llama_model_free(model)
