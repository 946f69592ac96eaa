"""DFlashDrafter (drafters/dflash.py): losslessness with a DFlash head in the loop, the head's
context-cache sync, its q rows, confidences and stop rule, and how `edgespec.load` opens a DFlash
head GGUF (and refuses one made for another target).

Fast tests run a random numpy DFlashHead on ReferenceFeatureBackend, whose next-token distribution
is known exactly. Real tests run the libllama head (LlamaDFlashHead) on a tiny 4-layer llama
target with SmolLM2's vocabulary: a random head, almost never right, so output must stay exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_fixtures import build_tiny_llama
from head_oracles import DFlashHead, oracle_drafter
from test_lossless_reference import PROMPTS, _empirical, _exact_marginals

import edgespec
from edgespec.backends.reference import ReferenceFeatureBackend
from edgespec.drafters.dflash import DFlashDrafter
from edgespec.drafters.heads import head_arch
from edgespec.drafters.registry import open_backend, open_drafter, open_target
from edgespec.engine import Engine
from edgespec.errors import EdgespecError, VocabMismatchError
from edgespec.heads.dflash import DFlashConfig, random_tensors
from edgespec.heads.dflash_gguf import write_dflash_gguf
from edgespec.sampling import SamplingParams, process

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95)
N_VOCAB = 49152  # SmolLM2's tokenizer, shared by the tiny targets


def _reference_head(target: ReferenceFeatureBackend, seed: int = 3, block_size: int = 5) -> DFlashHead:
    """A random head for the 6-token reference target (T = 3 feature blocks of H = 7) that never
    drafts 'f' (its d2t lacks token 5, which is also its MASK)."""
    cfg = DFlashConfig(n_embd=target.n_embd, n_layer=1, n_head=1, n_head_kv=1, n_ff=16, target_layers=(1, 2, 3),
                       n_vocab=target.n_vocab, n_draft_vocab=5, mask_token_id=5, block_size=block_size,
                       n_rot=6, rope_base=10000.0)
    return DFlashHead(cfg, random_tensors(cfg, seed=seed, d2t=np.arange(5), std=2.0, own_embd=True))


def _reference(seed: int = 3, block_size: int = 5) -> tuple[ReferenceFeatureBackend, DFlashDrafter]:
    target = ReferenceFeatureBackend(6, seed=3)
    return target, DFlashDrafter(_reference_head(target, seed, block_size), target)


def _fresh_logits(head, target, context: list[int], n: int) -> np.ndarray:
    """Block rows of a new head fed the whole committed context in one batch."""
    head.inject(target.features(0, len(context) - 1))
    return head.block_logits(head.block_tokens(context[-1], n + 1))


# -- reference backend (fast) ------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, 4, 9])
def test_greedy_spec_equals_plain_on_reference(gamma):
    """γ = 4 is the whole block (B − 1); γ = 9 is clamped to it."""
    target, drafter = _reference()
    engine = Engine(target, drafter, num_draft=gamma)
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_tokens=48, speculative=False)
        spec = engine.generate(prompt, max_tokens=48)
        assert spec.tokens == plain.tokens, prompt
        assert all(d <= min(gamma, 4) for d, _ in spec.stats.cycles)
        accepted, drafted = accepted + spec.stats.n_accepted, drafted + spec.stats.n_drafted
    print(f"γ={gamma}: accepted {accepted} of {drafted}")
    assert 0 < accepted < drafted


@pytest.mark.slow
def test_sampled_spec_with_dflash_matches_target_distribution():
    """The TV test of test_lossless_reference.py with the DFlash drafter in the loop: q is zero on a
    token the target does sample, so residual sampling is exercised. 20k draws (~14 s); expected TV of
    the empirical marginals ≈ 0.006 (measured 0.000, 0.002, 0.004, 0.005: position 0 is certain
    under top-p), the 0.015 bound ≈ 5σ away."""
    target, drafter = _reference()
    prompt, n_pos, draws = target.tokenize("abcabcab"), 4, 20_000
    exact, _ = _exact_marginals(target, prompt, SAMPLED, n_pos)
    assert (exact[:, 5] > 0.01).any()  # the target samples the token the head cannot draft
    engine = Engine(target, drafter, num_draft=3)
    spec, _ = _empirical(engine, prompt, SAMPLED, n_pos, draws)
    tv = [0.5 * float(np.abs(spec[pos] - exact[pos]).sum()) for pos in range(n_pos)]
    print("TV per position:", [f"{x:.4f}" for x in tv])
    for pos in range(n_pos):
        assert tv[pos] <= 0.015, (pos, spec[pos], exact[pos])
    s = engine.generate(prompt, max_tokens=64, temperature=0.8, top_p=0.95, seed=0).stats
    assert 0 < s.n_accepted < s.n_drafted


@pytest.mark.parametrize("accept", ["all", 1, 0])
def test_head_cache_after_a_cycle_equals_a_fresh_head(accept):
    """After a cycle whose drafts were all accepted (+ bonus), or cut after 1 or 0 of them, the
    synced head holds the K/V of a new head fed the committed context and gives its block logits."""
    target, drafter = _reference()
    ctx = target.tokenize("abcabcab")
    target.eval(ctx[:-1], rows="none")
    d = drafter.draft(ctx, 3, SAMPLED, np.random.default_rng(0))
    assert len(d.tokens) == 3 and drafter.head.n_past == len(ctx) - 1  # the block left no K/V
    target.eval([ctx[-1], *d.tokens], rows="all")  # the engine's verification pass
    n = 3 if accept == "all" else accept
    target.truncate(len(ctx) + n)
    other = next(t for t in range(6) if n == 3 or t != d.tokens[n])  # bonus, or a correction
    ctx = ctx + d.tokens[:n] + [other]
    drafter.sync(ctx)
    assert drafter.head.n_past == len(ctx) - 1
    assert drafter._synced == n  # rows injected beyond the one each cycle needs
    fresh = _reference_head(target)
    want = _fresh_logits(fresh, target, ctx, 4)
    got = drafter.head.block_logits(drafter.head.block_tokens(ctx[-1]))
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin) and fin.sum() == 5 * 5
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=1e-5)
    for mine, theirs in ((drafter.head._k, fresh._k), (drafter.head._v, fresh._v)):
        for a, b in zip(mine, theirs):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_head_cache_after_an_engine_run_equals_a_fresh_head():
    target, drafter = _reference()
    engine = Engine(target, drafter, num_draft=4)
    g = engine.generate("abcab", max_tokens=40)
    assert g.stats.n_accepted > 0
    ctx = target.tokenize("abcab") + g.tokens
    assert target.n_past == len(ctx) - 1
    drafter.sync(ctx)
    got = drafter.head.block_logits(drafter.head.block_tokens(ctx[-1]))
    want = _fresh_logits(_reference_head(target), target, ctx, 4)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=1e-5)


def test_confidence_q_rows_and_stop():
    target, drafter = _reference()
    ctx = target.tokenize("abcabc")
    target.eval(ctx[:-1], rows="none")
    seen = []

    def stop(conf):
        seen.append(list(conf))
        return len(conf) == 3

    d = drafter.draft(ctx, 4, SAMPLED, np.random.default_rng(1), stop=stop)
    assert len(d.tokens) == 2 and len(d.confidence) == 2 and len(seen) == 3  # asked before the 3rd draw
    assert d.q.shape == (2, 6) and np.allclose(d.q.sum(axis=1), 1) and (d.q[:, 5] == 0).all()
    assert d.confidence == pytest.approx(d.q.max(axis=1).tolist())
    assert all(5 != t for t in d.tokens)
    rows = drafter.head.block_logits(drafter.head.block_tokens(ctx[-1], 5))[1:]  # q_i: row i of the 4-draft block
    np.testing.assert_allclose(d.q, [process(r, SAMPLED) for r in rows[:2]], rtol=0, atol=1e-12)
    g = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(1))
    assert g.q is None and g.tokens == [int(t) for t in rows.argmax(axis=1)] and g.synced == 0
    p = np.exp(rows[0] - rows[0].max())
    assert g.confidence[0] == pytest.approx(p.max() / p.sum())


def test_timing_a_block_leaves_the_head_cache_alone():
    target, drafter = _reference()
    ctx = target.tokenize("cabbed")
    target.eval(ctx[:-1], rows="none")
    before = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(0)).tokens
    k = [x.copy() for x in drafter.head._k]
    assert drafter.measure_ms_per_token(repeats=3) > 0
    assert drafter.head.n_past == len(ctx) - 1 and all(np.array_equal(a, b) for a, b in zip(drafter.head._k, k))
    d = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(0))
    assert d.synced == 0 and d.tokens == before


def test_drafting_needs_the_targets_features():
    target, drafter = _reference()
    assert drafter.draft([0], 0, GREEDY, np.random.default_rng(0)).tokens == []
    assert len(drafter.draft([0], 3, GREEDY, np.random.default_rng(0)).tokens) == 3  # an empty context cache
    with pytest.raises(EdgespecError, match="needs target features"):
        drafter.draft([0, 1, 2], 3, GREEDY, np.random.default_rng(0))  # the target has evaluated nothing


# -- llama.cpp targets (real) ----------------------------------------------------------------------

BLOCK = 6


def _tiny_head_config(**kw) -> DFlashConfig:
    return DFlashConfig(**(dict(n_embd=64, n_layer=1, n_head=4, n_head_kv=2, n_ff=128, target_layers=(1, 3),
                                n_vocab=N_VOCAB, n_draft_vocab=N_VOCAB, mask_token_id=N_VOCAB - 1,
                                block_size=BLOCK, rope_base=10000.0) | kw))


@pytest.fixture(scope="module")
def tiny_dflash(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> tuple[Path, Path]:
    """A 4-layer tiny llama (H 64) and a random F32 DFlash head for it that reads its layers 1 and 3
    and borrows its token embeddings and LM head (as published DFlash heads do)."""
    d = tmp_path_factory.mktemp("dflash")
    target = build_tiny_llama(d / "tiny4.gguf", vocab_source=smollm2_path, n_layer=4, seed=0)
    cfg = _tiny_head_config()
    t = {k: v for k, v in random_tensors(cfg, seed=2).items() if k != "output.weight"}
    return target, write_dflash_gguf(d / "head.gguf", cfg, t, vocab_source=smollm2_path, weight_type="f32")


@pytest.mark.real
@pytest.mark.parametrize("gamma", [3, BLOCK - 1])
def test_greedy_spec_equals_plain_with_a_random_head(tiny_dflash, gamma):
    from edgespec.heads.dflash_llama import LlamaDFlashHead

    target, head = tiny_dflash
    assert head_arch(head) == "dflash" and head_arch(target) == "llama" and head_arch("ngram") is None
    with edgespec.load(target, drafter=head, n_ctx=512, threads=1, num_draft=gamma) as engine:
        assert isinstance(engine.drafter, DFlashDrafter) and isinstance(engine.drafter.head, LlamaDFlashHead)
        assert engine.target.feature_layers == (1, 3)
        drafted = 0
        for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]:
            plain = engine.generate(prompt, max_tokens=40, speculative=False)
            spec = engine.generate(prompt, max_tokens=40)
            assert spec.tokens == plain.tokens, prompt
            assert all(d <= gamma for d, _ in spec.stats.cycles)
            drafted += spec.stats.n_drafted
        assert drafted > 0
        ms = engine.drafter.measure_ms_per_token(repeats=5)
        print(f"γ={gamma}: drafted {drafted}; libllama block of 5: {4 * ms:.2f} ms ({ms:.2f} ms per draft token)")


@pytest.mark.real
@pytest.mark.parametrize("accept", ["all", 1])
def test_llama_head_cache_after_a_cycle_equals_a_fresh_head_and_numpy(tiny_dflash, accept):
    """The libllama head synced through a cycle gives the block logits of a fresh libllama head fed
    the committed context at once, and of the numpy head (impl="numpy") synced the same way."""
    from edgespec.heads.dflash_llama import LlamaDFlashHead

    target_path, head = tiny_dflash
    with open_target(target_path, head, n_ctx=256, threads=1) as target:
        drafter = open_drafter(head, target)
        ref = oracle_drafter(head, target)
        ctx = target.tokenize("The quick brown fox jumps over")
        target.eval(ctx[:-1], rows="none")
        d = drafter.draft(ctx, 3, GREEDY, np.random.default_rng(0))
        ref.draft(ctx, 3, GREEDY, np.random.default_rng(0))
        assert len(d.tokens) == 3 and drafter.head.n_past == len(ctx) - 1
        target.eval([ctx[-1], *d.tokens], rows="all")
        n = 3 if accept == "all" else accept
        target.truncate(len(ctx) + n)
        ctx = ctx + d.tokens[:n] + [17 if n == 3 or d.tokens[n] != 17 else 18]
        drafter.sync(ctx)
        ref.sync(ctx)
        block = drafter.head.block_tokens(ctx[-1])
        got = drafter.head.block_logits(block)
        with LlamaDFlashHead(head, target, threads=1) as fresh:
            want = _fresh_logits(fresh, target, ctx, BLOCK - 1)
        numpy = ref.head.block_logits(block)
        drafter.close()
    # F16 KV cache and flash attention (llama.cpp's defaults) against F32 numpy
    diff_fresh, diff_numpy = np.abs(got - want).max(), np.abs(got - numpy).max()
    print(f"libllama synced vs fresh {diff_fresh:.2e}, vs numpy {diff_numpy:.2e} (logits up to {np.abs(numpy).max():.1f})")
    assert diff_fresh <= 5e-3 and diff_numpy <= 2e-2


@pytest.mark.real
def test_a_head_for_another_target_is_refused(tiny_dflash, tiny_target, tmp_path, smollm2_path):
    target, head = tiny_dflash
    narrow = build_tiny_llama(tmp_path / "narrow.gguf", vocab_source=smollm2_path, n_layer=4, n_embd=32)
    with pytest.raises(EdgespecError, match=r"DFlash head .* hidden size 64, but target .* has hidden size 32") as e:
        edgespec.load(narrow, drafter=head)
    assert "\n" not in str(e.value)
    with pytest.raises(EdgespecError, match=r"reads target layers \(1, 3\), but target .* has 2 layers"):
        edgespec.load(tiny_target, drafter=head)
    with open_backend(target, n_ctx=64, threads=1) as plain:  # bench/profile open plain targets
        with pytest.raises(EdgespecError, match="DFlash head .* needs a target opened with its features"):
            open_drafter(head, plain)
    ref = ReferenceFeatureBackend(6)  # captures layers (1, 2, 3) of hidden size 7, 6 tokens
    cfg = _tiny_head_config(n_embd=7, n_head=1, n_head_kv=1, n_rot=6, target_layers=(1, 2, 3), n_draft_vocab=16)
    other = write_dflash_gguf(tmp_path / "h7.gguf", cfg, random_tensors(cfg), vocab_source=smollm2_path,
                              weight_type="f32")
    with pytest.raises(VocabMismatchError, match=r"vocabulary of 49152 tokens, but target .* has 6"):
        open_drafter(other, ref)


@pytest.mark.real
def test_cli_generate_with_a_dflash_head(tiny_dflash):
    from typer.testing import CliRunner

    from edgespec.cli.app import app

    target, head = tiny_dflash
    result = CliRunner().invoke(app, ["generate", "--target", str(target), "--drafter", str(head), "-k", "3",
                                      "-n", "16", "--threads", "1", "--ctx", "256", "-p", "Hello, world!"])
    assert result.exit_code == 0, result.output
    assert "τ" in result.stderr
