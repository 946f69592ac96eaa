"""The MLX DFlash head (edgespec.heads.dflash_mlx) against the numpy oracle (tests/head_oracles.py) on
random heads: context injected in chunks, truncation, block logits and hiddens, causal and
non-causal blocks, GQA, partial RoPE, the three scales, d2t, own or borrowed embeddings and LM head
(no model files). On MLX targets, as drafters: tests/test_head_drafters.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from head_oracles import DFlashHead, close_rel

mx = pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

from edgespec.heads.dflash import DFlashConfig, random_tensors  # noqa: E402
from edgespec.heads.dflash_mlx import MlxDFlashHead  # noqa: E402

V, VD, H, MASK = 100, 40, 32, 99


def _pair(seed: int = 0, own_embd: bool = True, as_mx: bool = False, **kw) -> tuple[DFlashHead, MlxDFlashHead]:
    """The same random head in numpy and on MLX, with non-trivial norms. Without own embeddings both
    borrow a target's token embeddings and (when V_d == V and there is no own output) its LM head,
    the MLX head as mx arrays when ``as_mx``."""
    base = dict(n_embd=H, n_layer=2, n_head=4, n_head_kv=2, n_ff=48, target_layers=(2, 5, 7), n_vocab=V,
                n_draft_vocab=VD, mask_token_id=MASK, block_size=6, rope_base=10000.0)
    cfg = DFlashConfig(**(base | kw))
    rng = np.random.default_rng(100 + seed)
    d2t = (np.sort(rng.choice(V, cfg.n_draft_vocab, replace=False)) if cfg.n_draft_vocab < V else None)
    t = random_tensors(cfg, seed=seed, d2t=d2t, own_embd=own_embd)
    for name in t:
        if name.endswith("norm.weight"):
            t[name] = (1 + 0.3 * rng.standard_normal(t[name].shape)).astype(np.float32)
    embd = output = None
    if not own_embd:
        embd = rng.standard_normal((V, H), dtype=np.float32)
        if cfg.n_draft_vocab == V:
            t.pop("output.weight")
            output = rng.standard_normal((V, H), dtype=np.float32)
    ref = DFlashHead(cfg, t, tok_embd=embd, output=output)
    if as_mx:
        embd, output = (None if m is None else mx.array(m) for m in (embd, output))
    return ref, MlxDFlashHead(cfg, t, tok_embd=embd, output=output)


def _features(n: int, cfg: DFlashConfig, seed: int) -> np.ndarray:
    return 2 * np.random.default_rng(seed).standard_normal((n, cfg.n_embd_enc), dtype=np.float32)


def _same_block(ref: DFlashHead, head: MlxDFlashHead, tokens: list[int]) -> None:
    (z_ref, h_ref), (z, h) = ref.forward_block(tokens), head.forward_block(tokens)
    close_rel(z, z_ref)
    close_rel(h, h_ref)
    assert head.draft(tokens[0], len(tokens) - 1) == ref.draft(tokens[0], len(tokens) - 1)


CASES = {"plain": {}, "causal": {"causal": True}, "no_d2t": {"n_draft_vocab": V},
         "mha_partial_rope": {"n_head_kv": 4, "n_rot": 4, "rope_base": 500.0},
         "scales": {"embedding_scale": 1.7, "attention_scale": 0.2, "value_scale": 0.8, "head_dim": 16, "n_head": 6, "n_head_kv": 3},
         "borrowed": {"own_embd": False}, "borrowed_mx": {"own_embd": False, "as_mx": True},
         "borrowed_lm_head": {"own_embd": False, "n_draft_vocab": V, "as_mx": True, "causal": True}}


@pytest.mark.parametrize("kw", list(CASES.values()), ids=list(CASES))
def test_mlx_head_equals_numpy(kw):
    """Context injected in chunks of 7, 1 and 5, a block at each step, then truncation and re-injection."""
    ref, head = _pair(**kw)
    cfg = ref.config
    feats = _features(13, cfg, seed=1)
    rng = np.random.default_rng(2)
    for lo, hi in ((0, 7), (7, 8), (8, 13)):
        close_rel(head.inject(feats[lo:hi]), ref.inject(feats[lo:hi]))
        assert head.n_past == ref.n_past == hi
        anchor = int(rng.integers(0, V))
        _same_block(ref, head, head.block_tokens(anchor))
        _same_block(ref, head, [anchor, int(rng.integers(0, V)), MASK])  # a short block, not only masks
    for h in (ref, head):
        h.truncate(4)
        h.inject(_features(3, cfg, seed=3))
    assert head.n_past == ref.n_past == 7
    _same_block(ref, head, head.block_tokens(5))
    assert head.block_size == 6 and head.mask_token_id == MASK


def test_block_leaves_the_cache_and_an_empty_context_works():
    ref, head = _pair()
    _same_block(ref, head, head.block_tokens(3))  # no context yet: the block attends to itself only
    head.inject(_features(4, head.config, seed=0))
    before = head.forward_block(head.block_tokens(3))[0]
    head.forward_block([1, 2, 3, 4, 5])
    assert head.n_past == 4 and np.array_equal(head.forward_block(head.block_tokens(3))[0], before)


def test_refusals():
    ref, head = _pair()
    with pytest.raises(ValueError, match="a block holds 1..6 tokens"):
        head.forward_block([1] * 7)
    with pytest.raises(ValueError, match="target ids in 0..99"):
        head.forward_block([1, V])
    with pytest.raises(ValueError, match=r"features must be \(n, 96\)"):
        head.inject(np.zeros((2, 95), np.float32))
    t = random_tensors(ref.config, seed=0)
    with pytest.raises(ValueError, match="token embeddings of shape"):
        MlxDFlashHead(ref.config, t)
    cfg = replace(ref.config, n_draft_vocab=V)
    no_lm = {k: v for k, v in random_tensors(cfg, seed=0).items() if k != "output.weight"}
    with pytest.raises(ValueError, match="an LM head of shape"):
        MlxDFlashHead(cfg, no_lm, tok_embd=np.zeros((V, H), np.float32))
