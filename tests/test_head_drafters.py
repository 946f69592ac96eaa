"""The feature-head drafter contract, one set of tests over every kind (EAGLE-3, DFlash, DSpark) and,
for real targets, every runtime of drafters.heads.HEAD_RUNTIMES (libllama, MLX).

Fast tests run each kind's numpy reference drafter on ReferenceFeatureBackend, whose next-token
distribution is known exactly (tests/head_cases.py): greedy spec == plain, the sampled TV test, the
head cache synced through a cycle or an engine run equals a fresh head's, q rows and confidences,
the stop rule, timing leaves the cache alone, drafting needs the target's features. Real tests run
tiny heads on tiny llama targets with SmolLM2's vocabulary on each runtime: greedy spec == plain, the
synced head equals a fresh one and the numpy oracle, heads for other targets are refused, the CLI."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_fixtures import build_tiny_llama
from head_cases import (
    BACKENDS,
    BLOCK,
    DRAFTER,
    GREEDY,
    HELD_OUT,
    KINDS,
    RUNTIMES,
    SAMPLED,
    chain_rows,
    fresh_view,
    greedy_lossless,
    kv,
    open_target,
    reference,
    tiny_head_config,
    view,
)
from head_oracles import close_rel, oracle_drafter
from mlx_fixtures import own_mlx_home  # noqa: F401 (MLX targets convert their GGUFs into a module's own home)
from test_lossless_reference import PROMPTS, _empirical, _exact_marginals, fixed_costs  # noqa: F401
from typer.testing import CliRunner

import edgespec
from edgespec.backends.reference import ReferenceFeatureBackend
from edgespec.drafters.eagle import EagleDrafter
from edgespec.drafters.heads import HEAD_RUNTIMES, head_arch, read_head
from edgespec.drafters.registry import open_backend, open_drafter
from edgespec.engine import Engine
from edgespec.errors import EdgespecError, VocabMismatchError
from edgespec.heads.dflash_gguf import write_dflash_gguf
from edgespec.heads.eagle3 import Eagle3Config, random_tensors
from edgespec.heads.gguf_io import write_eagle3_gguf
from edgespec.sampling import process

# kind → (γ values, max_tokens, acceptance floor) of the greedy test: γ 4 is a block kind's whole
# block (B − 1), 9 is clamped to it; measured EAGLE-3 acceptance: γ=1 0.47, γ=3 0.40
GREEDY_CASES = {"eagle3": ([1, 3, "auto"], 64, 0.3), "dflash": ([1, 3, 4, 9], 48, 0.0), "dspark": ([1, 4], 48, 0.0)}
# kind → (EAGLE-3 noise, draws, TV bound): expected TV ≈ 0.004 at 40k draws, ≈ 0.006 at 20k (≈ 5-6σ away)
TV_CASES = {"eagle3": (0.5, 40_000, 0.01), "dflash": (0.3, 20_000, 0.015), "dspark": (0.3, 20_000, 0.015)}
REAL = ["eagle3", "dflash", "dspark", "dspark-q8_0"]  # the tiny heads (head_cases.build_tiny_head)
RUNNER = {"llama": "Llama", "mlx": "Mlx", "eagle3": "Eagle3Head", "dflash": "DFlashHead", "dspark": "DFlashHead"}


def _block_cap(drafter, gamma) -> int:
    """The most drafts a cycle may have: γ, and B − 1 for a block kind."""
    return gamma if drafter.name == "eagle3" else min(gamma, drafter.head.block_size - 1)


# -- the reference backend (fast) --------------------------------------------------------------------


@pytest.mark.parametrize("kind, gamma", [(k, g) for k, (gs, _, _) in GREEDY_CASES.items() for g in gs])
def test_greedy_spec_equals_plain_on_reference(kind, gamma, request, monkeypatch):
    if gamma == "auto":
        request.getfixturevalue("fixed_costs")
        monkeypatch.setattr(EagleDrafter, "measure_ms_per_token", lambda self, repeats=8: 0.05)
    _, max_tokens, floor = GREEDY_CASES[kind]
    ref = reference(kind)
    stats = greedy_lossless(Engine(ref.target, ref.drafter, num_draft=gamma), PROMPTS, max_tokens)
    if gamma != "auto":
        assert all(d <= _block_cap(ref.drafter, gamma) for s in stats for d, _ in s.cycles)
    accepted, drafted = sum(s.n_accepted for s in stats), sum(s.n_drafted for s in stats)
    print(f"{kind} γ={gamma}: accepted {accepted} of {drafted}")
    assert 0 < accepted < drafted and accepted > floor * drafted


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_spec_matches_target_distribution(kind):
    """The TV test of test_lossless_reference.py with the head drafter in the loop: q is zero on a token
    the target does sample, so residual sampling is exercised (DSpark: q rows depend on the sampled
    prefix). Position 0 is certain under top-p."""
    noise, draws, bound = TV_CASES[kind]
    ref = reference(kind, noise=noise)
    prompt, n_pos = ref.target.tokenize("abcabcab"), 4
    exact, _ = _exact_marginals(ref.target, prompt, SAMPLED, n_pos)
    assert (exact[:, 5] > 0.01).any()  # the target samples the token the head cannot draft
    engine = Engine(ref.target, ref.drafter, num_draft=3)
    spec, _ = _empirical(engine, prompt, SAMPLED, n_pos, draws)
    tv = [0.5 * float(np.abs(spec[pos] - exact[pos]).sum()) for pos in range(n_pos)]
    print("TV per position:", [f"{x:.4f}" for x in tv])
    for pos in range(n_pos):
        assert tv[pos] <= bound, (pos, spec[pos], exact[pos])
    s = engine.generate(prompt, max_tokens=64, temperature=0.8, top_p=0.95, seed=0).stats
    assert 0 < s.n_accepted < s.n_drafted


def _same_as_fresh(ref, ctx, got: list[np.ndarray]) -> None:
    """`got` (the synced drafter's view) and its head's KV cache equal a fresh head's fed `ctx` at once."""
    fresh = ref.fresh()
    want = fresh_view(ref.drafter.name, fresh, ref.target, ctx)
    fin = np.isfinite(want[0])
    assert np.array_equal(np.isfinite(got[0]), fin) and fin.sum() == 5 * len(want[0])  # d2t: tokens 0..4
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a[np.isfinite(b)], b[np.isfinite(b)], rtol=0, atol=1e-5)
    for a, b in zip(kv(ref.drafter.head), kv(fresh), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("accept", ["all", 1, 0])
@pytest.mark.parametrize("kind", KINDS)
def test_head_cache_after_a_cycle_equals_a_fresh_head(kind, accept):
    """After a cycle whose drafts were all accepted (+ bonus), or cut after 1 or 0 of them, the synced
    head holds the KV entries of a new head fed the committed context and predicts what it predicts."""
    ref = reference(kind, noise=0.5)
    target, drafter = ref.target, ref.drafter
    ctx = target.tokenize("abcabcab")
    target.eval(ctx[:-1], rows="none")
    d = drafter.draft(ctx, 3, SAMPLED, np.random.default_rng(0))
    chained = 2 if kind == "eagle3" else 0  # an EAGLE-3 chain's steps stay cached; a block leaves no K/V
    assert len(d.tokens) == 3 and drafter.head.n_past == len(ctx) - 1 + chained
    target.eval([ctx[-1], *d.tokens], rows="all")  # the engine's verification pass
    n = 3 if accept == "all" else accept
    target.truncate(len(ctx) + n)
    other = next(t for t in range(6) if n == 3 or t != d.tokens[n])  # bonus, or a correction
    ctx = ctx + d.tokens[:n] + [other]
    got = view(drafter, ctx)
    assert drafter.head.n_past == len(ctx) - 1
    assert drafter._synced == n  # positions redone beyond the one each cycle needs
    _same_as_fresh(ref, ctx, got)


@pytest.mark.parametrize("kind", KINDS)
def test_head_cache_after_an_engine_run_equals_a_fresh_head(kind):
    ref = reference(kind, noise=0.0)
    g = Engine(ref.target, ref.drafter, num_draft=4).generate("abcab", max_tokens=40)
    assert g.stats.n_accepted > 0
    ctx = ref.target.tokenize("abcab") + g.tokens
    assert ref.target.n_past == len(ctx) - 1
    _same_as_fresh(ref, ctx, view(ref.drafter, ctx))


@pytest.mark.parametrize("kind", KINDS)
def test_q_rows_confidences_and_stop(kind):
    """Sampled: q rows are the processed rows the drafts were drawn from (each given the drafts before
    it), summing to 1 and zero off the draft vocabulary; `stop` is asked with each position's
    confidence before its draw. Greedy: the argmaxes, no q rows, no re-sync."""
    ref = reference(kind, noise=0.5)
    target, drafter = ref.target, ref.drafter
    ctx = target.tokenize("abcabc")
    target.eval(ctx[:-1], rows="none")
    seen = []

    def stop(conf):
        seen.append(list(conf))
        return len(conf) == 3

    d = drafter.draft(ctx, 4, SAMPLED, np.random.default_rng(1), stop=stop)
    assert len(d.tokens) == 2 and len(d.confidence) == 2 and len(seen) == 3  # asked before the 3rd draw
    assert seen[-1][:2] == d.confidence
    assert d.q.shape == (2, 6) and np.allclose(d.q.sum(axis=1), 1) and (d.q[:, 5] == 0).all()
    assert all(5 != t for t in d.tokens)
    rows, conf = chain_rows(drafter, ctx, d.tokens, 4, ref.fresh)
    np.testing.assert_allclose(d.q, [process(r, SAMPLED) for r in rows], rtol=0, atol=1e-12)
    assert d.confidence == pytest.approx(d.q.max(axis=1).tolist() if conf is None else conf)
    g = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(1))
    rows, conf = chain_rows(drafter, ctx, g.tokens, 4, ref.fresh)
    assert g.q is None and len(g.tokens) == 4 and g.synced == 0
    assert g.tokens == [int(np.argmax(r)) for r in rows]
    p = np.exp(rows - rows.max(axis=1, keepdims=True))
    assert g.confidence == pytest.approx((p.max(axis=1) / p.sum(axis=1)).tolist() if conf is None else conf)


@pytest.mark.parametrize("kind", KINDS)
def test_timing_leaves_the_head_cache_alone(kind):
    ref = reference(kind)
    target, drafter = ref.target, ref.drafter
    ctx = target.tokenize("cabbed")
    target.eval(ctx[:-1], rows="none")
    before = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(0)).tokens
    view(drafter, ctx)
    cache = [a.copy() for a in kv(drafter.head)]
    assert drafter.measure_ms_per_token(repeats=3) > 0
    assert drafter.head.n_past == len(ctx) - 1
    assert all(np.array_equal(a, b) for a, b in zip(kv(drafter.head), cache, strict=True))
    d = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(0))
    assert d.synced == 0 and d.tokens == before


@pytest.mark.parametrize("kind", KINDS)
def test_drafting_needs_the_targets_features(kind):
    """A one-token context: EAGLE-3 has no pair to draft from; a block kind drafts from an empty cache."""
    ref = reference(kind)
    rng = np.random.default_rng(0)
    assert ref.drafter.draft([0], 0, GREEDY, rng).tokens == []
    assert len(ref.drafter.draft([0], 3, GREEDY, rng).tokens) == (0 if kind == "eagle3" else 3)
    with pytest.raises(EdgespecError, match="needs target features"):
        ref.drafter.draft([0, 1, 2], 3, GREEDY, rng)  # the target has evaluated nothing


# -- tiny llama targets on each runtime (real) -------------------------------------------------------


def test_the_table_has_every_kind_on_every_runtime():
    assert set(HEAD_RUNTIMES) == {(k, r) for k in KINDS for r in BACKENDS}


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("gamma", [3, BLOCK - 1])
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", REAL)
def test_greedy_spec_equals_plain_on_a_tiny_target(tiny_head, name, runtime, gamma):
    target, head = tiny_head(name)
    kind, layers = name.split("-")[0], read_head(head).layers
    assert head_arch(head) == ("eagle3" if kind == "eagle3" else "dflash") and head_arch(target) == "llama"
    assert head_arch("ngram") is None
    with edgespec.load(target, drafter=head, backend=BACKENDS[runtime], n_ctx=512, threads=1,
                       num_draft=gamma) as engine:
        assert type(engine.drafter) is DRAFTER[kind] and engine.target.feature_layers == layers
        assert type(engine.drafter.head).__name__ == RUNNER[runtime] + RUNNER[kind]
        stats = greedy_lossless(engine, HELD_OUT, 40)
        assert all(d <= gamma for s in stats for d, _ in s.cycles)
        assert sum(s.n_drafted for s in stats) > 0
        ms = engine.drafter.measure_ms_per_token(repeats=5)
    print(f"{name} on {runtime}, γ={gamma}: {ms:.2f} ms per draft token")


# runtime → (atol of the synced head against a fresh one, against the numpy oracle), absolute on
# libllama (F16 KV cache and flash attention, its defaults, against F32 numpy), relative to the
# oracle's range on MLX (float32 against float64)
TOLERANCE = {"llama": (5e-3, 2e-2), "mlx": (1e-4, 1e-4)}


def _near(runtime: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
    if runtime == "mlx":
        close_rel(got, want, tol)
    else:
        fin = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), fin) and np.abs(got[fin] - want[fin]).max() <= tol


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("accept", ["all", 1])
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", REAL)
def test_synced_head_equals_a_fresh_head_and_the_oracle(tiny_head, name, runtime, accept):
    """The runtime's head synced through a cycle predicts what a fresh head of the same runtime fed the
    committed context at once predicts, and what the numpy oracle synced the same way does."""
    target_path, head = tiny_head(name)
    kind = name.split("-")[0]
    with open_target(target_path, head, BACKENDS[runtime], n_ctx=256, threads=1) as target:
        drafter, oracle = open_drafter(head, target), oracle_drafter(head, target)
        ctx = target.tokenize("The quick brown fox jumps over")
        target.eval(ctx[:-1], rows="none")
        if runtime == "mlx":  # float32 throughout: the same drafts and confidences
            d, o = (x.draft(ctx, 4, GREEDY, np.random.default_rng(0)) for x in (drafter, oracle))
            assert d.tokens == o.tokens and len(d.tokens) == 4
            np.testing.assert_allclose(d.confidence, o.confidence, rtol=0, atol=1e-4)
        d = drafter.draft(ctx, 3, GREEDY, np.random.default_rng(0))
        oracle.draft(ctx, 3, GREEDY, np.random.default_rng(0))
        target.eval([ctx[-1], *d.tokens], rows="all")
        n = 3 if accept == "all" else accept
        target.truncate(len(ctx) + n)
        ctx = ctx + d.tokens[:n] + [17 if n == 3 or d.tokens[n] != 17 else 18]
        got, want_oracle = view(drafter, ctx), view(oracle, ctx)
        assert drafter.head.n_past == oracle.head.n_past == len(ctx) - 1
        fresh = open_drafter(head, target)
        want_fresh = fresh_view(kind, fresh.head, target, ctx)
        for dr in (fresh, drafter):
            dr.close()
    to_fresh, to_oracle = TOLERANCE[runtime]
    for a, b, c in zip(got, want_fresh, want_oracle, strict=True):
        _near(runtime, a, b, to_fresh)
        _near(runtime, a, c, to_oracle)


def _vocab_mismatch_head(kind: str, path, vocab) -> object:
    """A head for ReferenceFeatureBackend(6)'s layers (1, 2, 3) and hidden size 7 with SmolLM2's 49152 tokens."""
    if kind == "eagle3":
        cfg = Eagle3Config(n_embd=8, n_head=1, n_head_kv=1, n_ff=16, n_embd_tgt=7, target_layers=(1, 2, 3),
                           n_vocab=49152, n_draft_vocab=16)
        return write_eagle3_gguf(path, cfg, random_tensors(cfg, own_embd=True), vocab_source=vocab, weight_type="f32")
    cfg = tiny_head_config(n_embd=7, n_head=1, n_head_kv=1, n_rot=6, target_layers=(1, 2, 3), n_draft_vocab=16,
                           **(dict(markov_rank=2) if kind == "dspark" else {}))
    return write_dflash_gguf(path, cfg, random_tensors(cfg), vocab_source=vocab, weight_type="f32")


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("name", ["eagle3", "dflash", "dspark"])
def test_a_head_for_another_target_is_refused(tiny_head, name, tiny_target, tmp_path, smollm2_path):
    """One-line errors: hidden size and layers (from the target's header, on either backend), a target
    opened without its features, the vocabulary."""
    target, head = tiny_head(name)
    kind = read_head(head).kind
    narrow = build_tiny_llama(tmp_path / "narrow.gguf", vocab_source=smollm2_path, n_layer=8, n_embd=32)
    with pytest.raises(EdgespecError, match=rf"{kind} head .* hidden size 64, but target .* has hidden size 32") as e:
        edgespec.load(narrow, drafter=head)
    assert "\n" not in str(e.value)
    for backend in BACKENDS.values():
        with pytest.raises(EdgespecError, match=r"reads target layers \(.*\), but target .* has 2 layers"):
            edgespec.load(tiny_target, drafter=head, backend=backend)
    with pytest.raises(EdgespecError, match="unknown backend 'tpu'"):
        edgespec.load(tiny_target, drafter=head, backend="tpu")
    with open_backend(target, n_ctx=64, threads=1) as plain:  # bench/profile open plain targets
        with pytest.raises(EdgespecError, match=f"{kind} head .* needs a target opened with its features"):
            open_drafter(head, plain)
    with pytest.raises(VocabMismatchError, match=r"vocabulary of 49152 tokens, but target .* has 6"):
        open_drafter(_vocab_mismatch_head(name, tmp_path / "h7.gguf", smollm2_path), ReferenceFeatureBackend(6))


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("runtime", RUNTIMES[1:])
@pytest.mark.parametrize("name", ["eagle3", "dspark"])
def test_a_runtime_the_table_lacks_is_refused(tiny_head, name, runtime):
    target, head = tiny_head(name)
    kind = read_head(head).kind
    with open_target(target, head, BACKENDS[runtime], n_ctx=64, threads=1) as t:
        with pytest.raises(EdgespecError, match=r"cannot run on 'numpy': .* heads run on llama, mlx$"):
            open_drafter(head, t, impl="numpy")
        with pytest.raises(EdgespecError, match=rf"the libllama {kind} head needs a llama.cpp target \(got mlx\)"):
            open_drafter(head, t, impl="llama")


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", ["eagle3", "dflash", "dspark"])
def test_cli_generate_with_a_head(tiny_head, name, runtime):
    from edgespec.cli.app import app

    target, head = tiny_head(name)
    result = CliRunner().invoke(app, ["generate", "--backend", BACKENDS[runtime], "--target", str(target), "--drafter",
                                      str(head), "-k", "3", "-n", "16", "--threads", "1", "--ctx", "256", "-p",
                                      "Hello, world!"])
    assert result.exit_code == 0, result.output
    assert "τ" in result.stderr


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("name", ["eagle3", "dflash", "dspark"])
def test_mlx_heads_are_timed_while_idle(tiny_head, name):
    """A first `-k auto` reply on an MLX target (no cost profile cached) decodes plainly; the idle run
    after it, on the engine's own thread, times the target and the head's draft step. MLX streams are
    per thread: a head's cache arrays left lazy on the generating thread failed there ("There is no
    Stream(cpu, 0) in current thread": the profile was never completed, so -k auto never drafted)."""
    from edgespec import calibration

    target, head = tiny_head(name)
    with edgespec.load(target, drafter=head, backend="mlx", n_ctx=256, num_draft="auto") as engine:
        profile = calibration.profile_path(engine.target)
        assert profile is not None
        profile.unlink(missing_ok=True)  # a first use
        assert engine.pricing.unknown()
        engine.generate(PROMPTS[0], max_tokens=8)
        assert engine.wait_priced(timeout=120)
        assert engine.idle_error is None, engine.idle_error
        assert not engine.pricing.unknown() and engine.pricing.draft_cost[engine.drafter] is not None
