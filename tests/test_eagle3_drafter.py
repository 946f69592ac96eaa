"""EagleDrafter (drafters/eagle.py): losslessness with a head in the loop, the head's KV sync, its
confidences and stop rule, and how `edgespec.load` / the CLI open a head GGUF.

Fast tests run a hand-built numpy head (tests/eagle_fixtures.py) on ReferenceFeatureBackend, whose
next-token distribution is known exactly. Real tests run the libllama head on llama.cpp targets: a
random head for SmolLM2 (almost never right: output must still be exact) and a least-squares head
for a tiny 8-layer target (right often enough that acceptance is measured)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from eagle_fixtures import fit_tiny_head, reference_head
from gguf_fixtures import build_tiny_llama
from test_lossless_reference import PROMPTS, _empirical, _exact_marginals, fixed_costs  # noqa: F401
from typer.testing import CliRunner

import edgespec
from edgespec.backends.reference import ReferenceFeatureBackend
from edgespec.drafters.eagle import EagleDrafter
from edgespec.drafters.registry import open_backend, open_drafter, open_target
from edgespec.engine import Engine
from edgespec.errors import EdgespecError
from edgespec.heads.eagle3 import Eagle3Config, random_tensors
from edgespec.heads.gguf_io import write_eagle3_gguf
from edgespec.sampling import SamplingParams, process

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95)
N_VOCAB = 49152  # SmolLM2's tokenizer, shared by the tiny targets
FIT_PROMPTS = ["The history of the city", "def add(a, b):", "Once upon a time", "import numpy as np", "Dear Sir,",
               "The weather today", "SELECT * FROM users", "In 1492, Columbus"]
HELD_OUT = ["The quick brown fox", "Hello, world!", "A long time ago", "What is the capital of France?"]


def _reference(noise: float = 0.3, d2t=range(5), seed: int = 3) -> tuple[ReferenceFeatureBackend, EagleDrafter]:
    """A 6-token reference target and a head that never drafts 'f' (its d2t lacks token 5)."""
    target = ReferenceFeatureBackend(6, seed=seed)
    return target, EagleDrafter(reference_head(target, noise=noise, d2t=d2t), target)


def _fresh(drafter: EagleDrafter, context: list[int], make) -> tuple[np.ndarray, object]:
    """The last-pair logits of a new head fed the whole committed context in one batch."""
    head = make()
    g = head.encode(drafter.target.features(0, len(context) - 1))
    logits, _ = head.decode(context[1:], g)
    return logits[-1], head


# -- reference backend (fast) ------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 3, "auto"])
def test_greedy_spec_equals_plain_on_reference(gamma, request, monkeypatch):
    if gamma == "auto":
        request.getfixturevalue("fixed_costs")
        monkeypatch.setattr(EagleDrafter, "measure_ms_per_token", lambda self, repeats=8: 0.05)
    target, drafter = _reference()
    engine = Engine(target, drafter, num_draft=gamma)
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_tokens=64, speculative=False)
        spec = engine.generate(prompt, max_tokens=64)
        assert spec.tokens == plain.tokens, prompt
        accepted, drafted = accepted + spec.stats.n_accepted, drafted + spec.stats.n_drafted
    assert 0.3 * drafted < accepted < drafted  # measured: γ=1 0.47 (243 of 521), γ=3 0.40 (414 of 1035)


@pytest.mark.slow
def test_sampled_spec_with_eagle_matches_target_distribution():
    """The TV test of test_lossless_reference.py with the EAGLE drafter in the loop: a noisy head
    whose q is zero on one token the target does sample, so residual sampling is exercised.
    40k draws (~40 s: the numpy head costs ~0.1 ms per call); expected TV of the empirical
    marginals ≈ 0.004, the 0.01 bound ≈ 6σ away."""
    target, drafter = _reference(noise=0.5)
    prompt, n_pos, draws = target.tokenize("abcabcab"), 4, 40_000
    exact, _ = _exact_marginals(target, prompt, SAMPLED, n_pos)
    assert (exact[:, 5] > 0.01).any()  # the target samples the token the head cannot draft
    engine = Engine(target, drafter, num_draft=3)
    spec, _ = _empirical(engine, prompt, SAMPLED, n_pos, draws)
    for pos in range(n_pos):
        assert 0.5 * np.abs(spec[pos] - exact[pos]).sum() <= 0.01, (pos, spec[pos], exact[pos])
    s = engine.generate(prompt, max_tokens=64, temperature=0.8, top_p=0.95, seed=0).stats
    assert 0 < s.n_accepted < s.n_drafted


@pytest.mark.parametrize("accept", ["all", 1, 0])
def test_head_cache_after_a_cycle_equals_a_fresh_head(accept):
    """After a cycle whose drafts were all accepted (+ bonus), or cut after 1 or 0 of them, the
    synced head gives the logits of a new head fed the committed context, with equal KV entries."""
    target, drafter = _reference(noise=0.5)
    make = lambda: reference_head(target, noise=0.5, d2t=range(5))  # noqa: E731
    ctx = target.tokenize("abcabcab")
    target.eval(ctx[:-1], rows="none")
    rng = np.random.default_rng(0)
    d = drafter.draft(ctx, 3, SAMPLED, rng)
    assert len(d.tokens) == 3 and drafter.head.n_past == len(ctx) - 1 + 2  # two chain steps
    target.eval([ctx[-1], *d.tokens], rows="all")  # the engine's verification pass
    n = 3 if accept == "all" else accept
    target.truncate(len(ctx) + n)
    other = next(t for t in range(6) if n == 3 or t != d.tokens[n])  # bonus, or a correction
    ctx = ctx + d.tokens[:n] + [other]
    logits, _ = drafter.sync(ctx)
    assert drafter.head.n_past == len(ctx) - 1
    assert drafter._synced == n  # pairs redone beyond the one each call needs
    want, fresh = _fresh(drafter, ctx, make)
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(logits), fin) and fin.sum() == 5
    np.testing.assert_allclose(logits[fin], want[fin], rtol=0, atol=1e-5)
    np.testing.assert_allclose(drafter.head._k, fresh._k, rtol=0, atol=1e-5)
    np.testing.assert_allclose(drafter.head._v, fresh._v, rtol=0, atol=1e-5)


def test_head_cache_after_an_engine_run_equals_a_fresh_head():
    target, drafter = _reference(noise=0.0)
    engine = Engine(target, drafter, num_draft=4)
    g = engine.generate("abcab", max_tokens=40)
    assert g.stats.n_accepted > 0
    ctx = target.tokenize("abcab") + g.tokens
    assert target.n_past == len(ctx) - 1
    logits, _ = drafter.sync(ctx)
    want, _ = _fresh(drafter, ctx, lambda: reference_head(target, noise=0.0, d2t=range(5)))
    fin = np.isfinite(want)
    np.testing.assert_allclose(logits[fin], want[fin], rtol=0, atol=1e-5)


def test_confidence_q_rows_and_stop():
    target, drafter = _reference(noise=0.5)
    ctx = target.tokenize("abcabc")
    target.eval(ctx[:-1], rows="none")
    seen = []

    def stop(conf):
        seen.append(list(conf))
        return len(conf) == 3

    d = drafter.draft(ctx, 5, SAMPLED, np.random.default_rng(1), stop=stop)
    assert len(d.tokens) == 2 and len(d.confidence) == 2 and len(seen) == 3  # asked before the 3rd draw
    assert d.q.shape == (2, 6) and np.allclose(d.q.sum(axis=1), 1) and (d.q[:, 5] == 0).all()
    assert d.confidence == pytest.approx(d.q.max(axis=1).tolist())
    assert all(5 != t for t in d.tokens)
    first, _ = drafter.sync(ctx)  # the first position's confidence is known before its draw
    assert d.confidence[0] == pytest.approx(process(first, SAMPLED).max())
    g = drafter.draft(ctx, 3, GREEDY, np.random.default_rng(1))
    assert g.q is None and len(g.tokens) == 3 and g.tokens[0] == int(np.argmax(first))
    p = np.exp(first - first.max())
    assert g.confidence[0] == pytest.approx(p.max() / p.sum())


def test_timing_a_chain_step_leaves_the_head_cache_alone():
    target, drafter = _reference()
    ctx = target.tokenize("cabbed")
    target.eval(ctx[:-1], rows="none")
    before, _ = drafter.sync(ctx)
    k = drafter.head._k.copy()
    assert drafter.measure_ms_per_token(repeats=3) > 0
    assert drafter.head.n_past == len(ctx) - 1 and np.array_equal(drafter.head._k, k)
    d = drafter.draft(ctx, 2, GREEDY, np.random.default_rng(0))
    assert d.synced == 0 and d.tokens[0] == int(np.argmax(before))


def test_nothing_to_draft_from_a_one_token_context():
    target, drafter = _reference()
    assert drafter.draft([0], 3, GREEDY, np.random.default_rng(0)).tokens == []
    with pytest.raises(EdgespecError, match="needs target features"):
        drafter.draft([0, 1, 2], 3, GREEDY, np.random.default_rng(0))  # the target has evaluated nothing


# -- llama.cpp targets (real) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_head(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A random F16 head for SmolLM2 (H 576, layers 2/15/27, V_d 8192)."""
    cfg = Eagle3Config(n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_embd_tgt=576, target_layers=(2, 15, 27),
                       n_vocab=N_VOCAB, n_draft_vocab=8192)
    d2t = np.sort(np.random.default_rng(0).choice(N_VOCAB, 8192, replace=False))
    return write_eagle3_gguf(tmp_path_factory.mktemp("e3d") / "smol-head.gguf", cfg,
                             random_tensors(cfg, seed=5, d2t=d2t), vocab_source=smollm2_path)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> tuple[Path, Path]:
    """An 8-layer tiny target whose layers add little (layer_scale 0.1) and a least-squares head."""
    d = tmp_path_factory.mktemp("e3d")
    target = build_tiny_llama(d / "tiny8.gguf", vocab_source=smollm2_path, n_layer=8, seed=0, layer_scale=0.1)
    return target, fit_tiny_head(target, d / "tiny8-head.gguf", smollm2_path, FIT_PROMPTS)


@pytest.mark.real
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_spec_equals_plain_with_a_random_head_on_smollm2(smollm2_path, smollm2_head, gamma):
    from edgespec.heads.eagle3_llama import LlamaEagle3Head

    with edgespec.load(smollm2_path, drafter=smollm2_head, n_ctx=512, threads=1, num_draft=gamma) as engine:
        assert isinstance(engine.drafter, EagleDrafter) and isinstance(engine.drafter.head, LlamaEagle3Head)
        drafted = 0
        for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]:
            plain = engine.generate(prompt, max_tokens=40, speculative=False)
            spec = engine.generate(prompt, max_tokens=40)
            assert spec.tokens == plain.tokens, prompt
            drafted += spec.stats.n_drafted
        assert drafted > 0 or gamma == "auto"


@pytest.mark.real
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_a_fitted_head_is_accepted_and_output_stays_exact(tiny_pair, gamma, request, monkeypatch):
    """Held-out prompts. With "auto", costs are fixed as on the reference backend (T(k) = 1 + 0.1(k−1)
    ms, 0.05 ms per draft token): the tiny target's real T(1) (~0.4 ms) is about one chain step of
    this head, where auto measured would take plain steps only."""
    if gamma == "auto":
        request.getfixturevalue("fixed_costs")
        monkeypatch.setattr(EagleDrafter, "measure_ms_per_token", lambda self, repeats=8: 0.05)
    target, head = tiny_pair
    with edgespec.load(target, drafter=head, n_ctx=512, threads=1, num_draft=gamma) as engine:
        cycles = []
        for prompt in HELD_OUT:
            plain = engine.generate(prompt, max_tokens=64, speculative=False)
            spec = engine.generate(prompt, max_tokens=64)
            assert spec.tokens == plain.tokens, prompt
            cycles += [c for c in spec.stats.cycles if c[0] > 0]
    drafted, accepted = sum(d for d, _ in cycles), sum(n for _, n in cycles)
    first = sum(n > 0 for _, n in cycles) / max(1, len(cycles))
    print(f"γ={gamma}: {len(cycles)} drafting cycles, accepted {accepted} of {drafted} drafts, first position {first:.2f}")
    assert accepted >= 0.25 * drafted and first >= 0.4  # measured γ=3: 0.42 of drafts, 0.59 at position 1


@pytest.mark.real
@pytest.mark.parametrize("accept", ["all", 1])
def test_llama_head_cache_after_a_cycle_equals_a_fresh_head(tiny_pair, accept):
    from edgespec.heads.eagle3_llama import LlamaEagle3Head

    target_path, head = tiny_pair
    with open_target(target_path, head, n_ctx=256, threads=1) as target:
        drafter = open_drafter(head, target)
        ctx = target.tokenize("The quick brown fox jumps over")
        target.eval(ctx[:-1], rows="none")
        d = drafter.draft(ctx, 3, GREEDY, np.random.default_rng(0))
        target.eval([ctx[-1], *d.tokens], rows="all")
        n = 3 if accept == "all" else accept
        target.truncate(len(ctx) + n)
        ctx = ctx + d.tokens[:n] + [17 if n == 3 or d.tokens[n] != 17 else 18]
        logits, h = drafter.sync(ctx)
        with LlamaEagle3Head(head, target, threads=1) as fresh:
            want, want_h = fresh.decode(ctx[1:], fresh.encode(target.features(0, len(ctx) - 1)), rows="last")
        drafter.close()
    np.testing.assert_allclose(logits, want[0], rtol=0, atol=5e-3)  # F16 KV cache, batched vs chunked
    np.testing.assert_allclose(h, want_h, rtol=0, atol=5e-3)


@pytest.mark.real
def test_cli_generate_with_a_head(tiny_pair):
    from edgespec.cli.app import app

    target, head = tiny_pair
    result = CliRunner().invoke(app, ["generate", "--target", str(target), "--drafter", str(head), "-k", "3",
                                      "-n", "16", "--threads", "1", "--ctx", "256", "-p", "Hello, world!"])
    assert result.exit_code == 0, result.output
    assert "τ" in result.stderr


@pytest.mark.real
def test_bench_with_a_head_runs_plain_on_a_plain_backend(tiny_pair, tmp_path, monkeypatch):
    """`edgespec bench --drafter head.gguf`: speculative runs on the feature-capturing target, plain runs on
    a plain backend of the same file; greedy outputs agree across the two."""
    import json

    import edgespec.bench.run as bench_run
    from edgespec.backends.llama_features import LlamaFeatureBackend
    from edgespec.cli.app import app

    real, seen = bench_run.run_matrix, {}

    def spy(engine, drafters, configs, tasks, temps, repeats, chat, on_run, plain_engine=None):
        seen["spec"], seen["plain"] = type(engine.target), type(plain_engine.target)
        return real(engine, drafters, configs, tasks, temps, repeats, chat, on_run, plain_engine)

    monkeypatch.setattr(bench_run, "run_matrix", spy)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    target, head = tiny_pair
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "--target", str(target), "--drafter", str(head), "-k", "3",
                                      "--max-tokens", "24", "--per-category", "1", "--category", "code_edit",
                                      "--category", "story", "--threads", "1", "--ctx", "512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert seen["spec"] is LlamaFeatureBackend and not issubclass(seen["plain"], LlamaFeatureBackend)
    runs = json.loads((out / "results.json").read_text())["runs"]
    spec = [r for r in runs if r["config"] != "plain"]
    assert len(spec) == 2 and all(r["matches_plain"] for r in spec)
    assert sum(sum(c[0] for c in r["cycles"]) for r in spec) > 0  # it drafted


@pytest.mark.real
def test_profile_costs_a_head(tiny_pair, tmp_path, monkeypatch):
    from edgespec.cli.app import app

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    target, head = tiny_pair
    result = CliRunner().invoke(app, ["profile", "--model", str(target), "--drafter", str(head), "--max-k", "4",
                                      "--repeats", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "ms per drafted token" in result.output and "E[τ(γ)]" in result.output


@pytest.mark.real
def test_a_head_for_another_target_is_refused(smollm2_head, tiny_pair, tiny_target, smollm2_path):
    target, head = tiny_pair
    with pytest.raises(EdgespecError, match=r"hidden size 576, but target .* has hidden size 64") as e:
        edgespec.load(target, drafter=smollm2_head)
    assert "\n" not in str(e.value)
    with pytest.raises(EdgespecError, match=r"reads target layers \(2, 4, 5\), but target .* has 2 layers"):
        edgespec.load(tiny_target, drafter=head)
    with open_backend(target, n_ctx=64, threads=1) as plain:  # bench/profile open plain targets
        with pytest.raises(EdgespecError, match="needs a target opened with its features"):
            open_drafter(head, plain)
