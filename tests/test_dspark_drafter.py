"""DSparkDrafter (drafters/dspark.py): the chained Markov drafts and confidence-head confidences,
losslessness with a DSpark head in the loop (greedy equality, sampled TV), how `edgespec.load`
opens a DSpark GGUF, and the libllama DSpark head against the numpy one.

Fast tests run a random numpy DSpark head on ReferenceFeatureBackend (as test_dflash_drafter.py
does for DFlash); real tests a random head on the tiny 4-layer llama with SmolLM2's vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_fixtures import build_tiny_llama
from head_oracles import DFlashHead, oracle_drafter
from test_dflash_drafter import BLOCK, GREEDY, SAMPLED, _tiny_head_config
from test_lossless_reference import PROMPTS, _empirical, _exact_marginals

import edgespec
from edgespec.backends.reference import ReferenceFeatureBackend
from edgespec.drafters.dspark import DSparkDrafter
from edgespec.drafters.registry import open_target
from edgespec.engine import Engine
from edgespec.heads.dflash import DFlashConfig, random_tensors
from edgespec.heads.dflash_gguf import write_dflash_gguf
from edgespec.heads.dspark import MarkovHead
from edgespec.sampling import process


def _reference(seed: int = 3, conf: bool = True) -> tuple[ReferenceFeatureBackend, DSparkDrafter]:
    """The 6-token reference target and a random DSpark head that never drafts 'f' (token 5, its MASK)
    with a strong Markov head (std 2), so chaining changes drafts."""
    target = ReferenceFeatureBackend(6, seed=3)
    cfg = DFlashConfig(n_embd=target.n_embd, n_layer=1, n_head=1, n_head_kv=1, n_ff=16, target_layers=(1, 2, 3),
                       n_vocab=target.n_vocab, n_draft_vocab=5, mask_token_id=5, block_size=5, n_rot=6,
                       rope_base=10000.0, markov_rank=3, has_confidence=conf)
    t = random_tensors(cfg, seed=seed, d2t=np.arange(5), std=2.0, own_embd=True)
    return target, DSparkDrafter(DFlashHead(cfg, t), target, MarkovHead(cfg, t))


def _chain(drafter: DSparkDrafter, ctx: list[int], tokens: list[int], n: int = 4) -> tuple[np.ndarray, list[float]]:
    """Row r's biased logits and confidence given the drafted prefix, from one block of n drafts
    (the block's rows attend to each other, so its length matters)."""
    z, h = drafter.head.forward_block(drafter.head.block_tokens(ctx[-1], n + 1))
    prev = [ctx[-1], *tokens[:-1]]
    m = drafter.markov
    return np.stack([m.apply(z[r + 1], p) for r, p in enumerate(prev)]), [m.confidence(h[r + 1], p)
                                                                          for r, p in enumerate(prev)]


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_spec_equals_plain_on_reference(gamma):
    target, drafter = _reference()
    engine = Engine(target, drafter, num_draft=gamma)
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_tokens=48, speculative=False)
        spec = engine.generate(prompt, max_tokens=48)
        assert spec.tokens == plain.tokens, prompt
        accepted, drafted = accepted + spec.stats.n_accepted, drafted + spec.stats.n_drafted
    print(f"γ={gamma}: accepted {accepted} of {drafted}")
    assert 0 < accepted < drafted


def test_drafts_are_chained_and_confidences_are_the_heads():
    target, drafter = _reference()
    ctx = target.tokenize("abcabc")
    target.eval(ctx[:-1], rows="none")
    g = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(0))
    rows, conf = _chain(drafter, ctx, g.tokens)
    assert g.q is None and g.tokens == [int(r.argmax()) for r in rows] and g.confidence == pytest.approx(conf)
    z = drafter.head.forward_block(drafter.head.block_tokens(ctx[-1]))[0][1:]
    assert g.tokens != [int(r.argmax()) for r in z]  # the Markov head changed a draft
    seen = []

    def stop(c):
        seen.append(list(c))
        return len(c) == 4

    s = drafter.draft(ctx, 4, SAMPLED, np.random.default_rng(3), stop=stop)
    assert len(s.tokens) == 3 and len(seen) == 4 and seen[-1][:3] == s.confidence
    rows, conf = _chain(drafter, ctx, s.tokens)
    np.testing.assert_allclose(s.q, [process(r, SAMPLED) for r in rows], rtol=0, atol=1e-12)
    assert s.confidence == pytest.approx(conf) and all(0 < c < 1 for c in conf)
    assert all(t != 5 for t in s.tokens) and (s.q[:, 5] == 0).all()
    target, plain = _reference(conf=False)  # no confidence head: drafters.base.confidence of the biased row
    target.eval(ctx[:-1], rows="none")
    p = plain.draft(ctx, 2, SAMPLED, np.random.default_rng(3))
    assert p.confidence == pytest.approx(p.q.max(axis=1).tolist())


@pytest.mark.slow
def test_sampled_spec_with_dspark_matches_target_distribution():
    """test_dflash_drafter's TV test with the chained DSpark drafter (q rows depend on the sampled
    prefix): 20k draws, bound 0.015 ≈ 5σ."""
    target, drafter = _reference()
    prompt, n_pos, draws = target.tokenize("abcabcab"), 4, 20_000
    exact, _ = _exact_marginals(target, prompt, SAMPLED, n_pos)
    engine = Engine(target, drafter, num_draft=3)
    spec, _ = _empirical(engine, prompt, SAMPLED, n_pos, draws)
    tv = [0.5 * float(np.abs(spec[pos] - exact[pos]).sum()) for pos in range(n_pos)]
    print("TV per position:", [f"{x:.4f}" for x in tv])
    for pos in range(n_pos):
        assert tv[pos] <= 0.015, (pos, spec[pos], exact[pos])
    s = engine.generate(prompt, max_tokens=64, temperature=0.8, top_p=0.95, seed=0).stats
    assert 0 < s.n_accepted < s.n_drafted


# -- llama.cpp targets (real) ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=[("f32", 8), ("q8_0", 32)], ids=["markov-f32", "markov-q8_0"])
def tiny_dspark(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                smollm2_path: Path) -> tuple[Path, Path]:
    """The tiny 4-layer llama and a random F32 DSpark head for it (confidence head, a d2t of the first
    8192 ids with its own LM head; the target's token embeddings): rank 8 with an F32 markov_w1, and
    rank 32 with the Q8_0 markov_w1 that shipped heads have."""
    markov_type, rank = request.param
    d = tmp_path_factory.mktemp("dspark")
    target = build_tiny_llama(d / "tiny4.gguf", vocab_source=smollm2_path, n_layer=4, seed=0)
    cfg = _tiny_head_config(n_draft_vocab=8192, markov_rank=rank, has_confidence=True)
    return target, write_dflash_gguf(d / "dspark.gguf", cfg, random_tensors(cfg, seed=2), vocab_source=smollm2_path,
                                     weight_type="f32", markov_type=markov_type)


@pytest.mark.real
def test_llama_dspark_drafts_equal_numpy(tiny_dspark):
    """Greedy drafts of the libllama DSpark head (in-graph bias removed host-side) equal the numpy
    head's, and equal llama.cpp's own greedy chain (argmax of the rows it returns)."""
    from edgespec.heads.dflash_llama import LlamaDFlashHead

    target_path, head = tiny_dspark
    with open_target(target_path, head, n_ctx=256, threads=1) as target:
        ref = oracle_drafter(head, target)
        assert isinstance(ref, DSparkDrafter) and ref.name == "dspark"
        llama = DSparkDrafter(LlamaDFlashHead(head, target, threads=1, kv_type="f32", flash_attn=False,
                                              markov=ref.markov), target, ref.markov)
        changed = 0
        for text in ["The quick brown fox jumps over", "def fibonacci(n):", "Once upon a time"]:
            ctx = target.tokenize(text)
            target.truncate(0)
            target.eval(ctx[:-1], rows="none")
            a = llama.draft(ctx, BLOCK - 1, GREEDY, np.random.default_rng(0))
            b = ref.draft(ctx, BLOCK - 1, GREEDY, np.random.default_rng(0))
            assert a.tokens == b.tokens, text
            np.testing.assert_allclose(a.confidence, b.confidence, rtol=0, atol=1e-4)
            block = llama.head.block_tokens(ctx[-1])
            hd = llama.head
            hd._api.set_nextn(hd._ctx, True, False)  # llama.cpp's conf, broadcast over n_embd-wide rows
            assert [int(r.argmax()) for r in hd.block_logits(block)[1:]] == a.tokens  # llama.cpp's chain
            conf_cpp = [float(hd._api.get_nextn_ith(hd._ctx, i)[0]) for i in range(1, BLOCK)]
            hd._api.set_nextn(hd._ctx, False, False)
            print("llama.cpp conf", np.round(conf_cpp, 4), "edgespec", np.round(a.confidence, 4))
            np.testing.assert_allclose(conf_cpp, a.confidence, rtol=0, atol=1e-4)  # same chain, same conf
            z_llama, h_llama = llama.head.forward_block(block)
            z_np, h_np = ref.head.forward_block(block)
            fin = np.isfinite(z_np)
            assert np.array_equal(np.isfinite(z_llama), fin) and fin.sum() == BLOCK * 8192
            np.testing.assert_allclose(z_llama[fin], z_np[fin], rtol=0, atol=1e-3)
            np.testing.assert_allclose(h_llama, h_np, rtol=0, atol=1e-3)
            changed += a.tokens != [int(r.argmax()) for r in z_np[1:]]
            s = llama.draft(ctx, 3, SAMPLED, np.random.default_rng(1))  # a sampled chain: rows re-biased
            rows, conf = _chain(ref, ctx, s.tokens, n=3)
            np.testing.assert_allclose(s.q, [process(r, SAMPLED) for r in rows], rtol=0, atol=1e-4)
            np.testing.assert_allclose(s.confidence, conf, rtol=0, atol=1e-4)
        assert changed  # the Markov head mattered somewhere
        llama.close()
        with pytest.raises(ValueError, match="is a DSpark head: pass its MarkovHead"):
            LlamaDFlashHead(head, target, threads=1)


@pytest.mark.real
def test_load_opens_a_dspark_head_and_greedy_spec_equals_plain(tiny_dspark):
    from edgespec.heads.dflash_llama import LlamaDFlashHead

    target, head = tiny_dspark
    with edgespec.load(target, drafter=head, n_ctx=512, threads=1, num_draft=4) as engine:
        assert isinstance(engine.drafter, DSparkDrafter) and isinstance(engine.drafter.head, LlamaDFlashHead)
        drafted = 0
        for prompt in ["The capital of France is", "def fibonacci(n):"]:
            plain = engine.generate(prompt, max_tokens=32, speculative=False)
            spec = engine.generate(prompt, max_tokens=32)
            assert spec.tokens == plain.tokens, prompt
            drafted += spec.stats.n_drafted
        assert drafted > 0
