"""The MLX DFlash head (edgespec.heads.dflash_mlx) against the numpy reference (heads.dflash) on
random heads: context injected in chunks, truncation, block logits and hiddens, causal and
non-causal blocks, GQA, partial RoPE, the three scales, d2t, own or borrowed embeddings and LM head
(no model files). Then on an MLX target (real: the tiny 4-layer llama with SmolLM2's vocabulary,
converted): `edgespec.load(..., backend="mlx")` runs a DFlash or DSpark head on MLX, greedy
speculative output equals plain greedy output, and its drafts equal the numpy head's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf_fixtures import build_tiny_llama
from head_oracles import DFlashHead, oracle_drafter
from mlx_fixtures import own_mlx_home  # noqa: F401 (used by the real tests)
from test_dflash_drafter import GREEDY, _tiny_head_config

mx = pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

import edgespec  # noqa: E402
from edgespec.drafters.dflash import DFlashDrafter  # noqa: E402
from edgespec.drafters.dspark import DSparkDrafter  # noqa: E402
from edgespec.drafters.registry import open_drafter, open_target  # noqa: E402
from edgespec.heads.dflash import DFlashConfig, random_tensors  # noqa: E402
from edgespec.heads.dflash_gguf import write_dflash_gguf  # noqa: E402
from edgespec.heads.dflash_mlx import MlxDFlashHead  # noqa: E402

V, VD, H, MASK = 100, 40, 32, 99
RTOL = 1e-4  # max |MLX − numpy| over the reference's range (float32 vs the reference's float64)


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


def _close(got: np.ndarray, want: np.ndarray) -> float:
    """Relative max difference on the finite entries; the −inf pattern must be identical."""
    fin = np.isfinite(want)
    assert got.shape == want.shape and np.array_equal(np.isfinite(got), fin)
    diff = float(np.abs(got[fin] - want[fin]).max() / (want[fin].max() - want[fin].min()))
    assert diff <= RTOL, diff
    return diff


def _same_block(ref: DFlashHead, head: MlxDFlashHead, tokens: list[int]) -> None:
    (z_ref, h_ref), (z, h) = ref.forward_block(tokens), head.forward_block(tokens)
    _close(z, z_ref)
    _close(h, h_ref)
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
        _close(head.inject(feats[lo:hi]), ref.inject(feats[lo:hi]))
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


# -- on an MLX target (real) -------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict[str, Path]:
    """The tiny 4-layer llama, a random F32 DFlash head borrowing its token embeddings and LM head,
    and a random DSpark head (rank 8, confidence head, d2t of the first 8192 ids, own LM head)."""
    d = tmp_path_factory.mktemp("dflash_mlx")
    target = build_tiny_llama(d / "tiny4.gguf", vocab_source=smollm2_path, n_layer=4, seed=0)
    cfg = _tiny_head_config()
    t = {k: v for k, v in random_tensors(cfg, seed=2).items() if k != "output.weight"}
    dflash = write_dflash_gguf(d / "dflash.gguf", cfg, t, vocab_source=smollm2_path, weight_type="f32")
    cfg = _tiny_head_config(n_draft_vocab=8192, markov_rank=8, has_confidence=True)
    dspark = write_dflash_gguf(d / "dspark.gguf", cfg, random_tensors(cfg, seed=2), vocab_source=smollm2_path,
                               weight_type="f32")
    return {"target": target, "dflash": dflash, "dspark": dspark}


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_greedy_spec_equals_plain_with_a_head_on_mlx(tiny_heads, kind):
    drafter_class = DSparkDrafter if kind == "dspark" else DFlashDrafter
    with edgespec.load(tiny_heads["target"], drafter=tiny_heads[kind], backend="mlx", n_ctx=512, threads=1,
                       num_draft=3) as engine:
        assert type(engine.drafter) is drafter_class and isinstance(engine.drafter.head, MlxDFlashHead)
        assert engine.target.feature_layers == (1, 3)
        drafted = 0
        for prompt in PROMPTS:
            plain = engine.generate(prompt, max_tokens=32, speculative=False)
            spec = engine.generate(prompt, max_tokens=32)
            assert spec.tokens == plain.tokens, prompt
            drafted += spec.stats.n_drafted
        assert drafted > 0


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_mlx_head_drafts_what_the_numpy_head_drafts_on_mlx(tiny_heads, kind):
    """Both impls on one MLX target (the MLX head borrowing the target's MLX weights, the numpy head
    its GGUF's), synced through a partly rejected cycle: the same block logits and drafts."""
    with open_target(tiny_heads["target"], tiny_heads[kind], "mlx", n_ctx=256, threads=1) as target:
        a = open_drafter(tiny_heads[kind], target)
        b = oracle_drafter(tiny_heads[kind], target)
        assert isinstance(a.head, MlxDFlashHead) and isinstance(b.head, DFlashHead)
        ctx = target.tokenize("The quick brown fox jumps over")
        target.eval(ctx[:-1], rows="none")
        da, db = a.draft(ctx, 4, GREEDY, np.random.default_rng(0)), b.draft(ctx, 4, GREEDY, np.random.default_rng(0))
        assert da.tokens == db.tokens and len(da.tokens) == 4
        np.testing.assert_allclose(da.confidence, db.confidence, rtol=0, atol=1e-4)
        target.eval([ctx[-1], *da.tokens], rows="none")
        target.truncate(len(ctx) + 1)
        ctx = ctx + da.tokens[:1] + [17 if da.tokens[1] != 17 else 18]
        a.sync(ctx)
        b.sync(ctx)
        assert a.head.n_past == b.head.n_past == len(ctx) - 1
        block = a.head.block_tokens(ctx[-1])
        (za, ha), (zb, hb) = a.head.forward_block(block), b.head.forward_block(block)
    _close(za, zb)
    _close(ha, hb)
