"""`--drafter ASSISTANT.gguf` on a Gemma-4 target: the assistant reads the target's KV cache and hidden
rows (tests/gemma4_fixtures.py: a tiny gemma4 + gemma4-assistant pair converted by llama.cpp's own
converter; skipped without it). Greedy == plain at γ 1 and 3 on the default pair, and at -k auto, with
drafts made and accepted, on gemma4_pair_agreeing (llama.cpp only: no MLX assistant drafter)."""

from __future__ import annotations

import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gemma4_fixtures import gemma4_pair, gemma4_pair_agreeing  # noqa: F401  # fixtures
from mtp_fixtures import pin_fastest_profile, qwen35_mtp  # noqa: F401  # a fixture
from test_mtp import GREEDY, PROMPT, chi_square, exact_pairs

import edgespec
from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.llama_mtp import LlamaMtpTarget, MtpUnavailableError
from edgespec.drafters.assistant import AssistantDrafter
from edgespec.session import Session, plan


def _plain(target: Path) -> list[int]:
    with edgespec.load(target, drafter=None, n_ctx=512, threads=1) as engine:
        return engine.generate(PROMPT, max_tokens=64, temperature=0).tokens


@pytest.fixture(scope="module")
def plain_tokens(gemma4_pair) -> list[int]:  # noqa: F811
    return _plain(gemma4_pair[0])


@pytest.fixture(scope="module")
def agreeing_plain_tokens(gemma4_pair_agreeing) -> list[int]:  # noqa: F811
    return _plain(gemma4_pair_agreeing[0])


def check_greedy_assistant(pair: tuple[Path, Path], plain: list[int], gamma: int | str) -> None:
    """The assistant at `gamma` emits the plain greedy tokens, twice (the second from the cached prompt);
    at a fixed γ with full and partial acceptances both seen; at auto with drafts made and accepted, the
    target's T(k) pinned to its own fastest timings (mtp_fixtures.pin_fastest_profile)."""
    target, assistant = pair
    if gamma == "auto":
        with LlamaMtpTarget(target, n_ctx=512, threads=1) as t:
            pinned = pin_fastest_profile(t)
    with edgespec.load(target, drafter=str(assistant), num_draft=gamma, n_ctx=512, threads=1) as engine:
        assert isinstance(engine.target, LlamaMtpTarget) and isinstance(engine.drafter, AssistantDrafter)
        out = engine.generate(PROMPT, max_tokens=64, temperature=0)
        again = engine.generate(PROMPT, max_tokens=64, temperature=0)
        if gamma == "auto":
            assert engine.pricing.t_forward == pinned
    assert out.tokens == plain and again.tokens == plain
    cycles = out.stats.cycles
    drafted, accepted = sum(d for d, _ in cycles), sum(n for _, n in cycles)
    print(f"\n{target.name} assistant γ={gamma}: {accepted}/{drafted} drafts accepted in {len(cycles)} cycles "
          f"(again: {again.stats.n_accepted}/{again.stats.n_drafted})")
    if gamma != "auto":
        assert any(d and n == d for d, n in cycles) and any(n < d for d, n in cycles)  # full and partial
    else:
        assert drafted > 0 and accepted > 0


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_assistant_equals_plain(gemma4_pair, plain_tokens, gamma):  # noqa: F811
    check_greedy_assistant(gemma4_pair, plain_tokens, gamma)


def test_greedy_assistant_auto_drafts_and_equals_plain(gemma4_pair_agreeing, agreeing_plain_tokens):  # noqa: F811
    """`-k auto` prices the assistant (its T(1), timed at load) against the target (its own fastest
    timings; no cost made up), picks it and drafts, on the pair built for it (gemma4_fixtures.AGREEING:
    a default pair's target step costs ~1.6 assistant steps and T(2) ~2·T(1): no acceptance pays there)."""
    check_greedy_assistant(gemma4_pair_agreeing, agreeing_plain_tokens, "auto")


def test_the_assistant_leaves_the_target_as_it_was(gemma4_pair):  # noqa: F811
    """Drafting writes nothing into the target's (shared) KV cache: its next forward is the same."""
    target, assistant = gemma4_pair
    with LlamaMtpTarget(target, n_ctx=256, threads=1) as t:
        drafter = AssistantDrafter(assistant, t)
        try:
            ctx = t.tokenize(PROMPT)
            t.eval(ctx[:-1], rows="none")
            before = t.eval([ctx[-1]], rows="last")[0]
            t.truncate(len(ctx) - 1)
            draft = drafter.draft(ctx, 4, GREEDY, np.random.default_rng(0))
            assert len(draft.tokens) == 4 and t.n_past == len(ctx) - 1
            np.testing.assert_array_equal(t.eval([ctx[-1]], rows="last")[0], before)
            cost = drafter.cost_prior()
            print(f"\nassistant cost prior: {cost.per_token_ms:.3f} ms a token")
            assert cost.per_token_ms > 0 and t.n_past == len(ctx)
        finally:
            drafter.close()


@pytest.fixture(scope="module")
def sampled(gemma4_pair):  # noqa: F811
    with edgespec.load(gemma4_pair[0], drafter=str(gemma4_pair[1]), num_draft=1, n_ctx=256, threads=1) as engine:
        yield engine, *exact_pairs(engine, PROMPT)


def test_sampled_assistant_keeps_the_target_distribution(sampled):
    t0 = time.perf_counter()
    p, drafted, accepted = chi_square(*sampled, n_runs=3000)
    print(f"\nsampled assistant: {accepted}/{drafted} accepted, chi-square p = {p:.3f}, "
          f"{time.perf_counter() - t0:.1f} s")
    assert drafted >= 3000 and 0.05 * drafted < accepted < 0.95 * drafted
    assert p > 0.001


def test_plain_baseline_of_an_assistant_session(gemma4_pair):  # noqa: F811
    with Session(plan(gemma4_pair[0], str(gemma4_pair[1]), n_ctx=128, threads=1)) as session:
        assert type(session.plain_engine().target) is LlamaCppBackend


# -- an assistant that does not fit its target: one line each --------------------------------------


def _assistant_header(path: Path, width: int, tokens: list[str]) -> Path:
    w = gguf.GGUFWriter(path, "gemma4-assistant")
    w.add_uint32("gemma4-assistant.embedding_length_out", width)
    w.add_token_list(tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_assistant_on_another_architecture(gemma4_pair, qwen35_mtp):  # noqa: F811
    with pytest.raises(MtpUnavailableError) as err:
        plan(qwen35_mtp[1], str(gemma4_pair[1]))
    msg = str(err.value)
    assert "\n" not in msg and "drafts for a gemma4 target" in msg and "is qwen35" in msg


def test_an_assistant_of_another_size_or_vocabulary(gemma4_pair, tmp_path):  # noqa: F811
    from edgespec.gguf_file import read_gguf

    tokens = list(read_gguf(gemma4_pair[0], lambda k: k == "tokenizer.ggml.tokens", with_tensors=False)
                  .value("tokenizer.ggml.tokens"))
    cases = [(_assistant_header(tmp_path / "narrow.gguf", 32, tokens), "reads 32-wide target rows"),
             (_assistant_header(tmp_path / "vocab.gguf", 64, tokens[:5] + ["x"] + tokens[6:]),
              "vocabularies differ (512 vs 512 tokens, first difference at id 5)")]
    for path, says in cases:
        with pytest.raises(MtpUnavailableError) as err:
            plan(gemma4_pair[0], str(path))
        assert "\n" not in str(err.value) and says in str(err.value)
