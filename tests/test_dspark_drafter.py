"""DSpark drafting beyond the shared head-drafter contract (tests/test_head_drafters.py): the chained
Markov drafts and the confidence head's confidences (on the reference backend), and the libllama DSpark
head against the numpy oracle with exact attention: its drafts, llama.cpp's own greedy chain and
confidences, and a sampled chain's re-biased rows."""

from __future__ import annotations

import numpy as np
import pytest
from head_cases import BLOCK, GREEDY, SAMPLED, chain_rows, open_target, reference
from head_oracles import oracle_drafter

from edgespec.drafters.dspark import DSparkDrafter
from edgespec.sampling import process


def test_drafts_are_chained_and_confidences_are_the_heads():
    ref = reference("dspark")
    target, drafter = ref.target, ref.drafter
    ctx = target.tokenize("abcabc")
    target.eval(ctx[:-1], rows="none")
    g = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(0))
    rows, conf = chain_rows(drafter, ctx, g.tokens, 4)
    assert g.q is None and g.tokens == [int(r.argmax()) for r in rows] and g.confidence == pytest.approx(conf)
    z = drafter.head.forward_block(drafter.head.block_tokens(ctx[-1]))[0][1:]
    assert g.tokens != [int(r.argmax()) for r in z]  # the Markov head changed a draft
    seen = []

    def stop(c):
        seen.append(list(c))
        return len(c) == 4

    s = drafter.draft(ctx, 4, SAMPLED, np.random.default_rng(3), stop=stop)
    assert len(s.tokens) == 3 and len(seen) == 4 and seen[-1][:3] == s.confidence
    rows, conf = chain_rows(drafter, ctx, s.tokens, 4)
    np.testing.assert_allclose(s.q, [process(r, SAMPLED) for r in rows], rtol=0, atol=1e-12)
    assert s.confidence == pytest.approx(conf) and all(0 < c < 1 for c in conf)
    assert all(t != 5 for t in s.tokens) and (s.q[:, 5] == 0).all()
    plain_ref = reference("dspark", conf=False)  # no confidence head: drafters.base.confidence of the biased row
    target, plain = plain_ref.target, plain_ref.drafter
    target.eval(ctx[:-1], rows="none")
    p = plain.draft(ctx, 2, SAMPLED, np.random.default_rng(3))
    assert p.confidence == pytest.approx(p.q.max(axis=1).tolist())


@pytest.mark.real
@pytest.mark.parametrize("name", ["dspark", "dspark-q8_0"])
def test_llama_dspark_drafts_equal_numpy(tiny_head, name):
    """Greedy drafts of the libllama DSpark head (in-graph bias removed host-side) equal the numpy
    head's, and equal llama.cpp's own greedy chain (argmax of the rows it returns)."""
    from edgespec.heads.dflash_llama import LlamaDFlashHead

    target_path, head = tiny_head(name)
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
            rows, conf = chain_rows(ref, ctx, s.tokens, 3)
            np.testing.assert_allclose(s.q, [process(r, SAMPLED) for r in rows], rtol=0, atol=1e-4)
            np.testing.assert_allclose(s.confidence, conf, rtol=0, atol=1e-4)
        assert changed  # the Markov head mattered somewhere
        llama.close()
        with pytest.raises(ValueError, match="is a DSpark head: pass its MarkovHead"):
            LlamaDFlashHead(head, target, threads=1)
