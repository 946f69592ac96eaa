"""`--drafter mtp` on llama.cpp: the target's own MTP ("nextn") head drafts, on the tiny Qwen3.5 + MTP
fixture (tests/mtp_fixtures.py, converted by llama.cpp's own converter: skipped without it).

Qwen3.5 is a Gated-DeltaNet hybrid, so every rejection also runs the recurrent rollback (restore the
checkpoint, re-evaluate the accepted tokens), which rewrites the target's nextn rows at their positions.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from mtp_fixtures import (  # noqa: F401
    convert_qwen35,
    fastest_mtp_prior,
    pin_fastest_profile,
    qwen35_mtp,
    qwen35_mtp_agreeing,
)
from scipy.stats import chisquare

import edgespec
from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.llama_mtp import LlamaMtpTarget, MtpUnavailableError
from edgespec.drafters.mtp import MtpDrafter
from edgespec.sampling import SamplingParams, process_rows
from edgespec.session import Session, plan

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def mtp_gguf(qwen35_mtp) -> Path:  # noqa: F811
    return qwen35_mtp[1]


@pytest.fixture(scope="module")
def plain_tokens(mtp_gguf) -> list[int]:
    with edgespec.load(mtp_gguf, drafter=None, n_ctx=512, threads=1) as engine:
        assert type(engine.target) is LlamaCppBackend  # plain decoding pays nothing for MTP
        return engine.generate(PROMPT, max_tokens=64, temperature=0).tokens


@pytest.mark.parametrize("drafter, gamma", [("mtp", 1), ("mtp", 3), ("ngram,mtp", 3)])
def test_greedy_mtp_equals_plain(mtp_gguf, plain_tokens, drafter, gamma):
    check_greedy_mtp(mtp_gguf, plain_tokens, drafter, gamma)


@pytest.fixture(scope="module")
def agreeing_plain(qwen35_mtp_agreeing) -> tuple[Path, list[int]]:  # noqa: F811
    """(GGUF, plain greedy tokens) of the fixture whose head agrees with its trunk (mtp_fixtures.AGREEING)."""
    path = qwen35_mtp_agreeing[1]
    with edgespec.load(path, drafter=None, n_ctx=512, threads=1) as engine:
        return path, engine.generate(PROMPT, max_tokens=64, temperature=0).tokens


@pytest.mark.parametrize("drafter", ["mtp", "ngram,mtp"])
def test_greedy_mtp_auto_drafts_and_equals_plain(agreeing_plain, drafter):
    """`-k auto` on the fixture built for it: the scheduler prices the head (its cost prior, timed at
    load, against the target's T(k), each the fastest of a few timings of this fixture: no cost is made up),
    picks it, drafts, and the drafts are accepted; the output is the plain output."""
    check_greedy_mtp(*agreeing_plain, drafter, "auto")


def check_greedy_mtp(path: Path, plain: list[int], drafter: str, gamma: int | str) -> tuple[int, int]:
    """`drafter` (mtp or a chain ending in it) at `gamma` on the MTP fixture at `path` emits the plain
    greedy tokens, twice (the second from the cached prompt); at a fixed γ, with full and partial
    acceptances both seen; at auto, with MTP drafts made and accepted (on a fixture whose head pays:
    mtp_fixtures.AGREEING). Returns the first generation's (drafted, accepted)."""
    if gamma == "auto":  # the target priced from its own fastest timings (mtp_fixtures.pin_fastest_profile)
        with LlamaMtpTarget(path, n_ctx=512, threads=1) as target:
            pinned = pin_fastest_profile(target)
    with contextlib.ExitStack() as pins:
        if gamma == "auto":  # and the head from its own (mtp_fixtures.fastest_mtp_prior)
            pins.enter_context(fastest_mtp_prior())
        engine = pins.enter_context(edgespec.load(path, drafter=drafter, num_draft=gamma, n_ctx=512, threads=1))
        assert isinstance(engine.target, LlamaMtpTarget)
        assert isinstance(engine.drafter if drafter == "mtp" else engine.drafter.members[-1], MtpDrafter)
        out = engine.generate(PROMPT, max_tokens=64, temperature=0)
        again = engine.generate(PROMPT, max_tokens=64, temperature=0)  # the cached prompt, synced again
        if gamma == "auto":
            assert engine.pricing.t_forward == pinned
    assert out.tokens == plain and again.tokens == plain
    cycles = out.stats.cycles
    drafted, accepted = sum(d for d, _ in cycles), sum(n for _, n in cycles)
    print(f"\n{Path(path).name} {drafter} γ={gamma}: {accepted}/{drafted} drafts accepted in {len(cycles)} cycles "
          f"(again: {again.stats.n_accepted}/{again.stats.n_drafted}; verified per member {dict(out.stats.by_member)})")
    if gamma != "auto":
        assert any(d and n == d for d, n in cycles) and any(n < d for d, n in cycles)  # full and partial
    else:  # the first generation drafts (how long it goes on drafting follows the cycles as timed)
        assert out.stats.n_drafted > 0 and out.stats.n_accepted > 0
        if drafter != "mtp":  # the chain verified the head's proposals, not only the n-gram's
            assert out.stats.by_member["mtp"] > 0, dict(out.stats.by_member)
    return drafted, accepted


def greedy_acceptance(path: Path) -> float:
    """Greedy acceptance of the MTP head of the fixture at `path`, at γ 3 over 128 new tokens."""
    with edgespec.load(path, drafter="mtp", num_draft=3, n_ctx=512, threads=1) as engine:
        out = engine.generate(PROMPT, max_tokens=128, temperature=0)
    assert len(out.tokens) == 128
    drafted = sum(d for d, _ in out.stats.cycles)
    rate = sum(n for _, n in out.stats.cycles) / drafted
    print(f"\n{Path(path).name} greedy acceptance at γ 3: {rate:.2f} of {drafted} drafts")
    return rate


def test_fixture_acceptance(mtp_gguf):
    """Greedy acceptance of the fixture's MTP head (quoted in mtp_fixtures)."""
    assert 0.2 < greedy_acceptance(mtp_gguf) < 0.95


def _sync_matches_fresh(drafter: MtpDrafter, target: LlamaMtpTarget, ctx: list[int]) -> None:
    """The drafter's head, synced to `ctx` incrementally, gives the logits and h a fresh head given
    `ctx` in one pass does; the target's rows (after its rollbacks) are a fresh target's."""
    logits, h, _ = drafter.sync(ctx)
    assert drafter.head.n_past == len(ctx) and drafter._kv == ctx
    fresh = MtpDrafter(target)
    try:
        f_logits, f_h, synced = fresh.sync(ctx)
        assert synced == len(ctx) - 1
    finally:
        fresh.close()
    span = float(f_logits.max() - f_logits.min())
    np.testing.assert_allclose(logits, f_logits, rtol=0, atol=1e-4 * span)
    np.testing.assert_allclose(h, f_h, rtol=0, atol=1e-4 * float(np.abs(f_h).max()))
    with LlamaMtpTarget(target.path, n_ctx=target.n_ctx, threads=1) as again:
        again.eval(ctx[:-1], rows="none")
        rows = again.hidden(0, len(ctx) - 1)
    np.testing.assert_allclose(target.hidden(0, len(ctx) - 1), rows, rtol=0, atol=1e-4 * float(np.abs(rows).max()))


def test_mtp_kv_stays_in_sync_after_partial_and_full_acceptance(mtp_gguf):
    """Cycles as the engine runs them, with the accepted count forced: partial, full, none, full."""
    rng = np.random.default_rng(0)
    with LlamaMtpTarget(mtp_gguf, n_ctx=256, threads=1) as target:
        drafter = MtpDrafter(target)
        try:
            ctx = target.tokenize(PROMPT)
            target.eval(ctx[:-1], rows="none")
            for accepted in (1, 3, 0, 3):
                draft = drafter.draft(ctx, 3, GREEDY, rng)
                assert len(draft.tokens) == 3
                assert drafter.head.n_past == len(ctx) + 2  # the chain's positions, cut by the next sync
                target.checkpoint()
                target.eval([ctx[-1], *draft.tokens], rows="none")  # the verification pass
                bonus = (draft.tokens[accepted] + 1) % target.n_vocab if accepted < 3 else 7
                new = [*ctx, *draft.tokens[:accepted], bonus]
                target.truncate(len(new) - 1)  # recurrent: restore + re-evaluate the accepted tokens
                assert drafter.sync(new)[2] == accepted  # the confirmed pairs, beside the pending one
                ctx = new
                _sync_matches_fresh(drafter, target, ctx)
            # a new prompt sharing a prefix: the head keeps that prefix only
            other = ctx[:5] + target.tokenize(" and then", add_special=False)
            target.truncate(0)
            target.eval(other[:-1], rows="none")
            assert drafter.sync(other)[2] == len(other) - 1 - 5
            _sync_matches_fresh(drafter, target, other)
        finally:
            drafter.close()


SAMPLED = dict(temperature=1.0, top_p=0.9)


def exact_pairs(engine, prompt: str) -> tuple[list[int], dict[tuple[int, int], float]]:
    """The prompt's ids and the exact distribution of the first two tokens sampled after it (SAMPLED),
    from the engine's target (left empty)."""
    params = SamplingParams(**SAMPLED)
    t = engine.target
    ids = t.tokenize(prompt)
    t.truncate(0)
    p1 = process_rows(t.eval(ids, rows="last"), params)[0].dense()
    t.checkpoint()
    exact = {}
    for x1 in np.flatnonzero(p1):
        t.truncate(len(ids))
        p2 = process_rows(t.eval([int(x1)], rows="last"), params)[0].dense()
        exact |= {(int(x1), int(x2)): p1[x1] * p2[x2] for x2 in np.flatnonzero(p2)}
    t.truncate(0)
    return ids, exact


@pytest.fixture(scope="module")
def sampled_pairs(mtp_gguf):
    """(engine, prompt ids, the exact distribution of the first two sampled tokens)."""
    with edgespec.load(mtp_gguf, drafter="mtp", num_draft=1, n_ctx=256, threads=1) as engine:
        yield engine, *exact_pairs(engine, PROMPT)


def chi_square(engine, ids, exact, n_runs: int) -> tuple[float, int, int]:
    """Chi-square p of the first two tokens over `n_runs` seeded runs against `exact` (cells with
    fewer than 5 expected runs pooled), and the drafts made and accepted."""
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(n_runs):
        out = engine.generate(ids, max_tokens=2, seed=seed, **SAMPLED)
        counts[tuple(out.tokens)] += 1
        drafted, accepted = drafted + out.stats.n_drafted, accepted + out.stats.n_accepted
    assert set(counts) <= set(exact)
    keys = sorted(exact, key=lambda k: -exact[k])
    expected = np.array([exact[k] for k in keys]) * n_runs
    observed = np.array([counts[k] for k in keys], float)
    big = expected >= 5
    f_obs, f_exp = observed[big], expected[big]
    if (~big).any():  # the rare outcomes pooled into one cell
        f_obs, f_exp = np.append(f_obs, observed[~big].sum()), np.append(f_exp, expected[~big].sum())
    return float(chisquare(f_obs, f_exp * f_obs.sum() / f_exp.sum()).pvalue), drafted, accepted


def test_sampled_mtp_keeps_the_target_distribution(sampled_pairs):
    """The first two tokens over seeded runs (γ = 1 in the first cycle: accept + bonus, or reject →
    residual + a plain step; the head's full q rows) against their exact distribution."""
    t0 = time.perf_counter()
    p, drafted, accepted = chi_square(*sampled_pairs, n_runs=3000)
    print(f"\nsampled mtp: {accepted}/{drafted} accepted, chi-square p = {p:.3f}, {time.perf_counter() - t0:.1f} s")
    assert drafted >= 3000 and 0.05 * drafted < accepted < 0.95 * drafted  # both branches, often
    assert p > 0.001


def test_the_chi_square_catches_a_biased_verifier(sampled_pairs, monkeypatch):
    """Power check (as tests/test_real_sampling.py's): a verifier that accepts x̃ with probability
    p(x̃) and after a rejection samples p again, x̃ not removed, over-produces the drafts; the same
    test rejects it."""
    import edgespec.engine
    from edgespec.sampling import process, sample

    def biased(logits, draft, q, params, rng, rows=None):
        rows = [] if rows is None else rows
        for i, x in enumerate(draft):
            rows.append(p := process(logits[i], params))
            if rng.random() >= p[x]:
                return i, sample(p, rng)
        rows.append(p := process(logits[len(draft)], params))
        return len(draft), sample(p, rng)

    monkeypatch.setattr(edgespec.engine, "verify_stochastic", biased)
    p, _, _ = chi_square(*sampled_pairs, n_runs=3000)
    print(f"\nbiased verifier: chi-square p = {p:.2e}")
    assert p < 0.001


def test_cost_prior_and_plain_baseline(mtp_gguf):
    with Session(plan(mtp_gguf, "mtp", n_ctx=256, threads=1)) as session:
        drafter = session.engine.drafter
        cost = drafter.cost_prior()
        print(f"\nmtp cost prior: fixed {cost.fixed_ms:.3f} ms + {cost.per_token_ms:.3f} ms a token")
        assert cost.per_token_ms > 0 and cost.fixed_ms >= 0 and drafter.head.n_past == 0
        assert type(session.plain_engine().target) is LlamaCppBackend


# -- bad input: one line each -----------------------------------------------------------------------


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


@pytest.mark.real
def test_mtp_on_a_target_without_nextn_layers(smollm2_path):
    with pytest.raises(MtpUnavailableError) as err:
        edgespec.load(smollm2_path, drafter="mtp")
    msg = _one_line(err)
    assert "architecture llama" in msg and "llama.nextn_predict_layers" in msg


def test_mtp_on_a_qwen35_converted_without_its_mtp_layers(qwen35_mtp, tmp_path):  # noqa: F811
    stripped = convert_qwen35(qwen35_mtp[0], tmp_path / "no-mtp.gguf", "--no-mtp")
    with edgespec.load(stripped, drafter=None, n_ctx=128, threads=1) as engine:  # a valid target still
        assert engine.generate("The", max_tokens=2, temperature=0).tokens
    with pytest.raises(MtpUnavailableError) as err:
        plan(stripped, "mtp")
    assert "qwen35.nextn_predict_layers" in _one_line(err)


@pytest.mark.parametrize("arch, n, says", [("llama", 1, "no MTP graph for architecture llama"),
                                           ("qwen35", 2, "qwen35 MTP graph takes exactly one")])
def test_mtp_on_an_architecture_whose_mtp_graph_libllama_lacks(tmp_path, arch, n, says):
    """Headers only: the check is made at plan time, before libllama sees the file (its qwen35 graph
    would abort the process on a second block: GGML_ASSERT)."""
    path = tmp_path / f"{arch}-nextn.gguf"
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.nextn_predict_layers", n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MtpUnavailableError) as err:
        plan(path, "mtp")
    assert says in _one_line(err)
