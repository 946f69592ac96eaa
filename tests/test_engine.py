"""Engine behaviour on the reference backend: KV consistency, cancel, stop, limits, streaming."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from edgespec.backends.reference import ReferenceBackend
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.drafters.registry import open_drafter
from edgespec.engine import Engine
from edgespec.errors import ContextOverflowError, EdgespecError
from edgespec.sampling import SamplingParams
from edgespec.text import StopMatcher, StreamDecoder


def _engine(gamma=3, **kw) -> Engine:
    t = ReferenceBackend(6, seed=5, **kw)
    return Engine(t, DraftModelDrafter(t.perturbed(0.5), t.n_vocab), num_draft=gamma)


def _consistent(engine: Engine) -> bool:
    return engine.target.n_past == len(engine._kv) and engine.target._tokens == engine._kv


def test_closing_the_stream_early_leaves_engine_reusable():
    engine = _engine()
    ref = engine.generate("abcab", max_tokens=40, temperature=0.8, seed=7)
    it = engine.stream("abcab", max_tokens=40)
    next(it), next(it)
    it.close()
    assert _consistent(engine)
    again = engine.generate("abcab", max_tokens=40, temperature=0.8, seed=7)
    assert again.tokens == ref.tokens and again.text == ref.text


def test_cancel_from_another_thread_stops_within_a_cycle():
    engine = _engine()
    chunks, started = [], threading.Event()

    def worker():
        for c in engine.stream("abcab", max_tokens=10_000, temperature=0.8, seed=1):
            chunks.append(c)
            started.set()
            if len(chunks) == 5:
                engine.cancel()
                cancelled_at.append(len(chunks))

    cancelled_at: list[int] = []
    th = threading.Thread(target=worker)
    th.start()
    th.join(timeout=30)
    assert not th.is_alive()
    assert chunks[-1].finish_reason == "cancelled" and len(chunks) == cancelled_at[0] + 1
    assert _consistent(engine)
    assert engine.generate("abc", max_tokens=5).finish_reason == "length"  # reusable


def test_draft_model_kv_stays_in_sync_after_full_acceptance():
    """A drafter identical to the target: every draft is accepted, so each cycle hands the drafter
    two tokens it has not seen (the last draft token and the bonus token)."""
    target = ReferenceBackend(6, seed=5)
    drafter = DraftModelDrafter(target.perturbed(0.0), 6)
    calls = []
    orig = drafter.draft

    def spy(context, gamma, params, rng):
        d = orig(context, gamma, params, rng)
        fresh = DraftModelDrafter(target.perturbed(0.0), 6).draft(context, gamma, params, rng)
        calls.append((list(context), d.tokens, fresh.tokens, list(drafter._kv), list(drafter.model._tokens)))
        return d

    drafter.draft = spy
    engine = Engine(target, drafter, num_draft=4)
    g = engine.generate("abc", max_tokens=50)
    assert g.stats.n_accepted == g.stats.n_drafted > 0  # full acceptance every cycle
    for context, got, fresh, kv, model_tokens in calls:
        assert got == fresh  # syncing the cache gave the same drafts as a cold start
        assert kv == model_tokens  # bookkeeping mirrors the model's cache
        assert kv[: len(context)] == context  # the whole context (incl. bonus token) was fed
    assert g.stats.tau == pytest.approx(5.0, abs=0.5)


def test_eos_stops_and_is_not_emitted():
    target = ReferenceBackend(6, seed=5, eos_id=2)
    engine = Engine(target, NgramDrafter(), num_draft=3)
    outs = [engine.generate("abcab", max_tokens=200, temperature=1.0, seed=s) for s in range(30)]
    assert any(o.finish_reason == "eos" for o in outs)
    for o in outs:
        assert 2 not in o.tokens and "c" not in o.text
        assert o.finish_reason in ("eos", "length")


def test_drafts_are_verified_up_to_their_first_end_token_only():
    """Nothing after an end-of-generation token can be emitted: the engine does not verify it."""
    from edgespec.drafters.base import Draft

    class EndsEarly:  # always drafts the end token, then more
        name, paths = "ends-early", ()

        def draft(self, context, gamma, params, rng, stop=None):
            return Draft([2, 3, 4, 5][:gamma])

        def cost_prior(self, note=None):
            return None

        def reset(self):
            pass

        def close(self):
            pass

    target = ReferenceBackend(6, seed=5, eos_id=2)
    spec = Engine(target, EndsEarly(), num_draft=4).generate("abcab", max_tokens=40, temperature=0)
    plain = Engine(ReferenceBackend(6, seed=5, eos_id=2), None).generate("abcab", max_tokens=40, temperature=0)
    assert spec.tokens == plain.tokens
    drafted = [d for d, _ in spec.stats.cycles]
    assert 1 in drafted and max(drafted) == 1  # [2] only, never [2, 3, 4, 5] (0: the last step, at max_tokens)


def test_stop_strings_cut_the_text():
    engine = _engine()
    full = engine.generate("abcab", max_tokens=60, temperature=1.0, seed=3)
    stop = full.text[10:12]
    cut = engine.generate("abcab", max_tokens=60, temperature=1.0, seed=3, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.find(stop)]


def test_max_tokens_and_context_limits():
    engine = _engine(gamma=6, n_ctx=32)
    g = engine.generate("abcab", max_tokens=7)
    assert len(g.tokens) == 7 and g.finish_reason == "length"
    g = engine.generate("abcab", max_tokens=1000)
    assert g.finish_reason == "length" and len(g.tokens) == 32 - 5 + 1
    with pytest.raises(ContextOverflowError, match="32"):
        engine.generate("ab" * 20, max_tokens=4)
    assert _consistent(engine)


def test_prompt_prefix_is_reused_between_generations():
    engine = _engine()
    engine.generate("abcabcabca", max_tokens=4)
    g = engine.generate("abcabcabcaddd", max_tokens=4)
    assert g.stats.n_prompt_evaluated <= 13 - 9  # at least the 9 shared tokens came from the cache


def test_bad_arguments_are_clear_errors():
    engine = _engine()
    with pytest.raises(EdgespecError, match="top_p"):
        engine.generate("ab", temperature=0.5, top_p=1.5)
    with pytest.raises(EdgespecError, match="temperature"):
        engine.generate("ab", temperature=-1)
    with pytest.raises(EdgespecError, match="num_draft"):
        engine.generate("ab", num_draft=-1)
    assert _consistent(engine)


def test_stats_count_draft_positions():
    engine = _engine(gamma=4)
    s = engine.generate("abcab", max_tokens=100).stats
    assert s.n_tokens == 100 and s.n_cycles < 100
    assert sum(s.accepted_at) == s.n_accepted and sum(s.drafted_at) == s.n_drafted
    assert all(a >= b for a, b in zip(s.accepted_at, s.accepted_at[1:]))  # acceptance is a prefix
    assert s.tau == pytest.approx(s.n_tokens / s.n_cycles)
    assert s.peak_rss_mb > 0


def test_stream_decoder_holds_split_utf8():
    pieces = {0: "日".encode()[:2], 1: "日".encode()[2:] + b"x", 2: b"\xff"}
    dec = StreamDecoder(pieces.__getitem__)
    assert dec.feed([0]) == ""
    assert dec.feed([1]) == "日x"
    assert dec.feed([2]) + dec.flush() == "\ufffd"


def test_stop_matcher_holds_back_partial_stop():
    m = StopMatcher(["</s>"])
    assert m.push("hello <") == "hello "
    assert m.push("/") == ""
    assert m.push("x") == "</x"
    assert m.push("end</s>tail") == "end" and m.hit


def test_ngram_lookup():
    d = NgramDrafter(n_max=3, n_min=2)
    ctx = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 2, 3])
    assert d.lookup(ctx, 3) == [5, 7, 2]  # latest match of [2, 3] is followed by 5 7 2
    assert d.lookup(np.array([1, 2, 3]), 3) == []
    assert d.draft([5, 6, 5, 6], 10, SamplingParams(), np.random.default_rng()).tokens == [5, 6]


@pytest.mark.parametrize("spec, sizes", [("ngram", (4, 2)), ("ngram:5", (5, 2)), ("ngram:3:3", (3, 3))])
def test_ngram_specs(spec: str, sizes: tuple[int, int]):
    d = open_drafter(spec, target=None)  # an n-gram drafter needs no target
    assert isinstance(d, NgramDrafter) and (d.n_max, d.n_min) == sizes


@pytest.mark.parametrize("spec, why", [("ngram:x", "whole numbers"), ("ngram:3:2:1", "whole numbers"),
                                       ("ngram:2:3", "n_min <= n_max"), ("ngram:-1", "whole numbers")])
def test_bad_ngram_specs_are_one_line_errors(spec: str, why: str):
    with pytest.raises(EdgespecError, match=f"bad n-gram drafter '{spec}'.*{re.escape(why)}"):
        open_drafter(spec, target=None)


def test_ngram_index_agrees_with_a_full_scan():
    """The incremental index gives the scan's answer as the context grows, is rolled back, or
    is replaced by another one."""
    rng, d, ref = np.random.default_rng(3), NgramDrafter(), NgramDrafter()
    ctx = list(rng.integers(0, 4, 5))
    for step in range(600):
        r = rng.random()
        if r < 0.7:
            ctx += list(rng.integers(0, 4, int(rng.integers(1, 4))))
        elif r < 0.9:
            ctx = ctx[: max(2, len(ctx) - int(rng.integers(1, 6)))]  # rejected drafts roll back
        else:
            ctx = list(rng.integers(0, 4, int(rng.integers(2, 30))))  # a new prompt
        gamma = int(rng.integers(1, 12))
        got = d.draft(ctx, gamma, SamplingParams(), rng).tokens
        assert got == ref.lookup(np.array(ctx), gamma), (step, ctx)


class _BatchVariant(ReferenceBackend):
    """A reference model whose forwards of more than 4 tokens come out slightly different, like
    llama.cpp's CPU K-quant kernels from 8 rows on."""

    def eval(self, tokens, rows="last"):
        out = super().eval(tokens, rows)
        if len(tokens) > 4 and rows == "all":  # enough to flip close calls
            out = out + np.float32(0.8) * np.sin(np.arange(out.size, dtype=np.float32)).reshape(out.shape)
        return out


class _ExactAtOne(ReferenceBackend):
    """Batched forwards differ from single steps from 2 tokens on, like F16/F32 weights on CPU."""

    def eval(self, tokens, rows="last"):
        out = super().eval(tokens, rows)
        return out + np.float32(1e-3) if len(tokens) > 1 and rows == "all" else out


def test_a_target_exact_only_at_one_token_is_found_in_a_few_steps():
    from edgespec.calibration import EXACT_FIRST, exact_batch

    target = _ExactAtOne(6, seed=5)
    assert exact_batch(target) == 1
    # one prefill, EXACT_FIRST single steps, the failed 2-token batch: no second context (~0.7 s for
    # SmolLM2 F32 here) and no single steps that no batch could pass
    assert target.n_evals == 1 + EXACT_FIRST + 1


def test_verification_is_split_where_the_backend_is_not_batch_invariant():
    from edgespec.calibration import exact_batch

    target = _BatchVariant(6, seed=5)
    assert exact_batch(target) == 4
    engine = Engine(target, NgramDrafter(), num_draft=9)
    for prompt in ["abcabcabcabc", "aaaa", "abababab"]:
        plain = engine.generate(prompt, max_tokens=64, speculative=False)
        spec = engine.generate(prompt, max_tokens=64)
        assert spec.tokens == plain.tokens and spec.stats.n_accepted > 0
    assert engine.pricing.exact == 4


def test_calibrating_a_used_draft_model_keeps_its_drafts_in_sync():
    """Timing the draft model for the scheduler reuses its KV cache: the drafter must re-read the
    context afterwards, not trust its stale mirror."""
    target = ReferenceBackend(6, seed=5)
    drafter = DraftModelDrafter(target.perturbed(0.3), target.n_vocab)
    engine = Engine(target, drafter, num_draft=3)
    before = engine.generate("abcabcab", max_tokens=40).stats.acceptance_rate
    engine.calibrate()  # the first auto generation would do this
    assert drafter._kv == [] and drafter.model.n_past == 0
    after = engine.generate("abcabcab", max_tokens=40).stats.acceptance_rate
    assert after == before


def test_a_second_concurrent_stream_is_refused_before_it_touches_the_cache():
    """Stream B would measure the exact batch and calibrate, which reset the target's KV cache:
    it must be refused first, so stream A's output and cache stay intact."""
    engine = _engine(gamma=3)
    ref = engine.generate("abcab", max_tokens=30, temperature=0.8, seed=7, speculative=False)
    engine.reset()
    a = engine.stream("abcab", max_tokens=30, temperature=0.8, seed=7, speculative=False)
    first = [next(a), next(a)]
    kv, evals = list(engine.target._tokens), engine.target.n_evals
    b = engine.stream("abc", max_tokens=5, num_draft="auto")  # the first auto run: would calibrate
    with pytest.raises(EdgespecError, match="already generating"):
        next(b)
    with pytest.raises(EdgespecError, match="already generating"):
        engine.calibrate()
    assert engine.target._tokens == kv and engine.target.n_evals == evals  # untouched
    rest = [c for c in a]
    assert [t for c in first + rest for t in c.tokens] == ref.tokens
    assert _consistent(engine)
    assert engine.generate("abc", max_tokens=5, num_draft="auto").finish_reason == "length"  # free again


def test_costs_are_public_after_calibration():
    engine = _engine(gamma=3)
    assert engine.costs is None
    engine.calibrate()
    costs = engine.costs
    assert costs is not None and 1 in costs.t_forward_ms and costs.exact_batch is not None


def test_common_prefix_agrees_with_a_token_by_token_scan():
    import random

    from edgespec.drafters.base import common_prefix

    def scan(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randint(0, 2) for _ in range(rng.randint(0, 200))]
        b = a[:rng.randint(0, len(a))] + [rng.randint(0, 2) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.5:
            a, b = b, a
        assert common_prefix(a, b) == scan(a, b)
        assert common_prefix(tuple(a), b) == scan(a, b)  # mixed sequence types
