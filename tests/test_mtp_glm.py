"""`--drafter mtp` on a second, attention-only MTP architecture: the tiny GLM-4.5-style MoE + nextn fixture
(tests/mtp_fixtures_glm.py, arch ``glm4moe``, converted by llama.cpp's own converter: skipped without it).

Unlike Qwen3.5 (test_mtp.py), the target keeps no recurrent state: a rejection is a plain KV-cache cut,
and the MTP block is MoE (sigmoid router with a selection bias, a shared expert). Checked here: the
libllama MTP logits that MtpDrafter reads equal an independent float64 torch port of the upstream forward
(tests/mtp_reference_glm.py) over positions with history and over a greedy chain; the head stays in sync
through forced partial / full / no acceptance; greedy speculative output equals plain decoding at γ 3 and
auto (on glm4moe_mtp_agreeing, a variant whose head pays: drafts made and accepted), alone and behind
an n-gram drafter; sampled output keeps the target's distribution.
"""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
from mtp_fixtures import no_flash_attn
from mtp_fixtures_glm import MEASURED_ACCEPTANCE, glm4moe_mtp, glm4moe_mtp_agreeing  # noqa: F401  # fixtures
from test_mtp import GREEDY, _sync_matches_fresh, check_greedy_mtp, chi_square, exact_pairs, greedy_acceptance

import edgespec
from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.llama_mtp import LlamaMtpTarget, check_mtp_target
from edgespec.drafters.mtp import MtpDrafter

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
TOL = 1e-4  # max |Δlogit| / logit range (issue #32)


@pytest.fixture(scope="module")
def glm_gguf(glm4moe_mtp):  # noqa: F811
    return glm4moe_mtp[1]


def test_glm_fixture_is_a_glm4moe_with_one_nextn_block(glm_gguf):
    r = gguf.GGUFReader(glm_gguf)
    kv = {k: f.contents() for k, f in r.fields.items()}
    names = {t.name for t in r.tensors}
    assert kv["general.architecture"] == "glm4moe" and kv["glm4moe.block_count"] == 3
    assert kv["glm4moe.nextn_predict_layers"] == 1 and kv["glm4moe.leading_dense_block_count"] == 1
    assert {"blk.2.nextn.eh_proj.weight", "blk.2.nextn.embed_tokens.weight", "blk.2.nextn.shared_head_head.weight",
            "blk.2.ffn_gate_inp.weight", "blk.2.exp_probs_b.bias", "blk.2.ffn_gate_exps.weight"} <= names
    assert check_mtp_target(glm_gguf) == ("glm4moe", 1)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / (want.max() - want.min()))


def test_glm_mtp_logits_equal_reference(glm4moe_mtp, monkeypatch):  # noqa: F811
    """MtpDrafter's logits (libllama's glm4moe MTP graph, fed the target's own rows) against the torch
    reference fed the same rows: the context grown in steps of 1-3 tokens (each sync keeps its prefix),
    then a greedy chain of 4; F32 weights and KV caches, flash attention off (measured: 1.2e-7 of the
    range; 1.9e-4 with ggml's CPU flash attention, libllama's default, which rounds through F16). The
    target's rows against transformers' Glm4MoeForCausalLM."""
    import mtp_reference_glm as ref

    hf, path = glm4moe_mtp
    cfg, sd = ref.load_hf(hf)
    no_flash_attn(monkeypatch)
    with LlamaMtpTarget(path, n_ctx=256, kv_type="f32", threads=1) as target:
        drafter = MtpDrafter(target)
        try:
            toks = target.tokenize(PROMPT + " there was", add_special=False)
            target.eval(toks[:-1], rows="none")
            h_t = target.hidden(0, len(toks) - 1)
            want = ref.context_logits(cfg, sd, toks, h_t)
            cuts = (3, 4, 5, 8, *range(9, len(toks) + 1))
            got = np.stack([drafter.sync(toks[:c])[0] for c in cuts])
            rel = _rel(got, want[[c - 1 for c in cuts]])
            drafted, chain_want = ref.greedy_chain(cfg, sd, toks, h_t, 4)
            logits, h, _ = drafter.sync(toks)
            chain, mine = [logits], []
            for i in range(4):
                mine.append(int(np.argmax(chain[-1])))
                if i < 3:
                    logits, h = drafter.head.decode([mine[-1]], h[None])
                    chain.append(logits)
            crel = _rel(np.stack(chain), chain_want)
            assert drafter.draft(toks, 4, GREEDY, np.random.default_rng(0)).tokens == drafted
        finally:
            drafter.close()
    h_hf = ref.target_hidden(hf, toks[:-1])
    dh = float(np.abs(h_t - h_hf).max())
    span = float(want.max() - want.min())
    print(f"\nglm4moe libllama MTP vs reference over {len(cuts)} positions: max |Δ| {rel * span:.2e} of a logit "
          f"range {span:.1f} ({rel:.1e}), chain {crel:.1e}; target h vs transformers {dh:.1e} "
          f"(|h| ≤ {np.abs(h_hf).max():.1f})")
    assert rel <= TOL and crel <= TOL
    assert mine == drafted
    assert dh <= 1e-3 * np.abs(h_hf).max()


def test_glm_mtp_kv_stays_in_sync_after_partial_and_full_acceptance(glm_gguf):
    """Cycles as the engine runs them, the accepted count forced: partial, full, none, full. The target's
    rollback is a KV cut here (no recurrent state)."""
    rng = np.random.default_rng(0)
    with LlamaMtpTarget(glm_gguf, n_ctx=256, threads=1) as target:
        assert not target.recurrent
        drafter = MtpDrafter(target)
        try:
            ctx = target.tokenize(PROMPT)
            target.eval(ctx[:-1], rows="none")
            for accepted in (1, 3, 0, 3):
                draft = drafter.draft(ctx, 3, GREEDY, rng)
                assert len(draft.tokens) == 3 and drafter.head.n_past == len(ctx) + 2
                target.eval([ctx[-1], *draft.tokens], rows="none")
                bonus = (draft.tokens[accepted] + 1) % target.n_vocab if accepted < 3 else 7
                new = [*ctx, *draft.tokens[:accepted], bonus]
                target.truncate(len(new) - 1)
                assert drafter.sync(new)[2] == accepted
                ctx = new
                _sync_matches_fresh(drafter, target, ctx)
        finally:
            drafter.close()


@pytest.fixture(scope="module")
def glm_plain_tokens(glm_gguf) -> list[int]:
    with edgespec.load(glm_gguf, drafter=None, n_ctx=512, threads=1) as engine:
        assert type(engine.target) is LlamaCppBackend
        return engine.generate(PROMPT, max_tokens=64, temperature=0).tokens


@pytest.mark.parametrize("drafter, gamma", [("mtp", 3), ("ngram,mtp", 3)])
def test_glm_greedy_mtp_equals_plain(glm_gguf, glm_plain_tokens, drafter, gamma):
    assert len(glm_plain_tokens) == 64
    check_greedy_mtp(glm_gguf, glm_plain_tokens, drafter, gamma)


@pytest.fixture(scope="module")
def glm_agreeing_plain(glm4moe_mtp_agreeing) -> tuple:  # noqa: F811
    """(GGUF, plain greedy tokens) of the fixture whose nextn head agrees with its trunk (AGREEING)."""
    path = glm4moe_mtp_agreeing[1]
    with edgespec.load(path, drafter=None, n_ctx=512, threads=1) as engine:
        return path, engine.generate(PROMPT, max_tokens=64, temperature=0).tokens


@pytest.mark.parametrize("drafter", ["mtp", "ngram,mtp"])
def test_glm_greedy_mtp_auto_drafts_and_equals_plain(glm_agreeing_plain, drafter):
    """`-k auto` prices, picks and drafts with the glm4moe nextn head (test_mtp.check_greedy_mtp: drafts
    made and accepted, output == plain; the target's T(k) its own fastest timings, no cost made up)."""
    assert len(glm_agreeing_plain[1]) == 64
    check_greedy_mtp(*glm_agreeing_plain, drafter, "auto")


def test_glm_fixture_acceptance(glm_gguf):
    """Greedy acceptance of the fixture's MTP head at γ 3 over 128 new tokens (MEASURED_ACCEPTANCE)."""
    assert abs(greedy_acceptance(glm_gguf) - MEASURED_ACCEPTANCE) < 0.1


# After PROMPT the fixture's first sampled token is certain; after this one it is spread (0.59, 0.40, 0.01),
# the head agrees with it about 0.6 (sum of min(p, q)), and the biased verifier below moves it far
SAMPLED_PROMPT = "def fib(n):\n    return"


@pytest.fixture(scope="module")
def glm_sampled_pairs(glm_gguf):
    """(engine, prompt ids, the exact distribution of the first two sampled tokens: test_mtp.exact_pairs)."""
    with edgespec.load(glm_gguf, drafter="mtp", num_draft=1, n_ctx=256, threads=1) as engine:
        yield engine, *exact_pairs(engine, SAMPLED_PROMPT)


def test_glm_sampled_mtp_keeps_the_target_distribution(glm_sampled_pairs):
    """The first two sampled tokens over seeded runs (γ 1: accept + bonus, or reject → residual + a plain
    step; the head's q rows) against their exact distribution (test_mtp.py's chi-square)."""
    t0 = time.perf_counter()
    p, drafted, accepted = chi_square(*glm_sampled_pairs, n_runs=2000)
    print(f"\nglm4moe sampled mtp: {accepted}/{drafted} accepted, chi-square p = {p:.3f}, "
          f"{time.perf_counter() - t0:.1f} s")
    assert drafted >= 2000 and 0.05 * drafted < accepted < 0.95 * drafted  # both branches, often
    assert p > 0.001


def test_glm_the_chi_square_catches_a_biased_verifier(glm_sampled_pairs, monkeypatch):
    """Power check (as test_mtp.py's): a verifier that accepts x̃ with probability p(x̃) and after a
    rejection samples p again, x̃ not removed, fails the same test on this fixture."""
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
    p, _, _ = chi_square(*glm_sampled_pairs, n_runs=2000)
    print(f"\nglm4moe biased verifier: chi-square p = {p:.2e}")
    assert p < 0.001
