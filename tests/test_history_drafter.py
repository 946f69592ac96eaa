"""HistoryDrafter: the suffix automaton against scans, recall across
generations, counts, the memory bound, adaptive length, privacy switches, the n-gram superset
property, registry specs and greedy losslessness through the Engine."""

from __future__ import annotations

import random
import time
from collections import Counter

import numpy as np
import pytest

from edgespec.backends.reference import ReferenceBackend
from edgespec.drafters.history import MIN_PROB, HistoryDrafter, SuffixAutomaton
from edgespec.drafters.ngram import NgramDrafter
from edgespec.drafters.registry import open_drafter
from edgespec.engine import Engine
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams

G, RNG = SamplingParams(), np.random.default_rng(0)


def draft(d, context, gamma=16):
    return d.draft(context, gamma, G, RNG)


def remember(d, *contexts):
    """Let `d` see each context as one finished generation."""
    for c in contexts:
        draft(d, list(c))
        d.reset()


# -- the structure, against scans ---------------------------------------------------------------------


def _scan_next(text, s):
    """(most frequent token after s in text, its count, all counted), ties to the latest; separators
    (< 0) are no continuation."""
    n, count, latest = len(s), Counter(), {}
    for e in range(n - 1, len(text) - 1):
        if text[e - n + 1: e + 1] == s and text[e + 1] >= 0:
            count[text[e + 1]] += 1
            latest[text[e + 1]] = e
    if not count:
        return None
    c = max(count, key=lambda t: (count[t], latest[t]))
    return c, count[c], sum(count.values())


def _scan_draft(docs, ctx, limit, min_match=2):
    """The draft by scanning: the longest suffix of ctx with a continuation, then the most frequent
    next token while the product of frequencies stays >= MIN_PROB (shortening a dead end)."""
    text = [t for k, doc in enumerate(docs) for t in [*doc, -3 - k]] + list(ctx)
    m = next((m for m in range(len(ctx), min_match - 1, -1) if _scan_next(text, list(ctx[-m:]))), 0)
    if not m:
        return [], 0
    s, out, prob = list(ctx[-m:]), [], 1.0
    while len(out) < limit(m):
        while (r := _scan_next(text, s)) is None and len(s) > min_match:
            s = s[1:]
        if r is None:
            break
        prob *= r[1] / r[2]
        if out and prob < MIN_PROB:
            break
        out.append(r[0])
        s.append(r[0])
    return out, m


def test_automaton_counts_every_substring():
    rnd = random.Random(3)
    for _ in range(30):
        text = [rnd.randrange(3) for _ in range(rnd.randrange(1, 60))]
        sam = SuffixAutomaton()
        sam.extend(text)
        for i in range(len(text)):
            for j in range(i + 1, min(len(text), i + 8) + 1):
                v = 0
                for c in text[i:j]:
                    v = sam.step(v, c)
                ends = [e for e in range(j - i - 1, len(text)) if text[e - (j - i) + 1: e + 1] == text[i:j]]
                assert (sam.occ[v], sam.end[v]) == (len(ends), ends[-1])


@pytest.mark.parametrize("run", [0, 8])
def test_drafts_equal_the_scan(run):
    """With history documents and the current context: the longest match, the most frequent
    continuation (ties → most recent), the walk and its probability cut, as a scan finds them."""
    rnd = random.Random(run)
    for _ in range(300):
        V = rnd.choice([2, 3, 4, 6])
        docs = [[rnd.randrange(V) for _ in range(rnd.randrange(1, 30))] for _ in range(rnd.randrange(0, 4))]
        ctx = [rnd.randrange(V) for _ in range(rnd.randrange(1, 40))]
        d = HistoryDrafter(10_000)
        remember(d, *docs)
        d._run = run  # the acceptance cap: max(4, 2·run, match)
        got = draft(d, ctx)
        want, m = _scan_draft(docs, ctx, lambda m: min(16, 2 * m, max(4, 2 * run, m)))
        assert got.tokens == want, (docs, ctx)
        assert got.support == (m if want else None)


# -- what it recalls ------------------------------------------------------------------------------------


def test_recalls_a_continuation_from_a_previous_generation():
    a = [100 + i for i in range(40)]  # a generation that contained the continuation 110, 111, ...
    d = HistoryDrafter()
    remember(d, [7, 8, 9] + a)
    b = [5, 6, 108, 109]  # a new request ending in 108, 109
    assert draft(d, b).tokens == [110, 111, 112, 113]
    assert draft(NgramDrafter(), b).tokens == []  # the current context alone knows nothing


def test_counts_decide_and_ties_go_to_the_most_recent():
    d = HistoryDrafter()
    remember(d, [1, 2, 3, 50], [1, 2, 3, 50], [1, 2, 3, 60])
    assert draft(d, [9, 2, 3]).tokens[0] == 50  # seen twice against once, although 60 is newer
    remember(d, [1, 2, 3, 60])
    assert draft(d, [9, 2, 3]).tokens[0] == 60  # 2 against 2: the most recent
    # within the current context too
    assert draft(HistoryDrafter(), [4, 5, 70, 4, 5, 80, 4, 5, 70, 1, 4, 5]).tokens[0] == 70
    assert draft(HistoryDrafter(), [4, 5, 70, 4, 5, 80, 1, 4, 5]).tokens[0] == 80


def test_a_longer_match_wins_over_counts_of_a_shorter_one():
    d = HistoryDrafter()
    remember(d, [2, 3, 50], [2, 3, 50], [2, 3, 50], [1, 2, 3, 60])
    assert draft(d, [1, 2, 3]).tokens[0] == 60
    assert draft(d, [1, 2, 3]).support == 3


def test_corpus_is_indexed_and_survives_clear():
    d = HistoryDrafter(corpus_tokens=[[30, 31, 32, 33, 34]])
    assert draft(d, [1, 31, 32]).tokens == [33, 34]
    remember(d, [40, 41, 42, 43])
    d.clear()
    assert draft(d, [1, 31, 32]).tokens == [33, 34]
    assert draft(d, [9, 41, 42]).tokens == []
    with pytest.raises(ValueError, match="more than half"):
        HistoryDrafter(100, corpus_tokens=[list(range(60))])


# -- memory bound ---------------------------------------------------------------------------------------


def test_memory_bound_evicts_the_oldest_documents_first():
    limit = 400
    d = HistoryDrafter(limit)
    docs = [[1000 * k + i for i in range(50)] for k in range(30)]  # 30 × 50 tokens, all distinct
    for doc in docs:
        for n in range(2, len(doc) + 1, 7):  # a generation growing call by call
            draft(d, doc[:n])
            assert d.indexed <= limit
        draft(d, doc)
        d.reset()
        assert d.indexed <= limit
    assert draft(d, [5, docs[-1][10], docs[-1][11]]).tokens[:2] == docs[-1][12:14]  # the newest: kept
    assert draft(d, [5, docs[0][10], docs[0][11]]).tokens == []  # the oldest: evicted
    # a context longer than the limit keeps its newest tokens indexed
    long = [10**6 + i for i in range(3 * limit)]
    for n in range(100, len(long) + 1, 100):
        draft(d, long[:n])
        assert d.indexed <= limit
    assert draft(d, long + long[-20:-18]).tokens[:3] == long[-18:-15]


# -- draft length -----------------------------------------------------------------------------------


def test_draft_length_follows_the_match_length():
    doc = list(range(100, 160))
    d = HistoryDrafter(alpha=1.0)
    remember(d, doc)
    assert len(draft(d, [1, 120, 121]).tokens) == 2  # match 2: alpha × 2
    d.reset()
    assert len(draft(d, [1, 119, 120, 121]).tokens) == 3
    d.reset()
    d.reset()
    assert len(draft(d, [1, *doc[20:26]]).tokens) == 6  # match 6, no run yet: the cap is the match
    d.reset()
    assert len(draft(d, [1, *doc[10:30]]).tokens) == 16  # match 20: as long as γ allows at once


def test_draft_length_grows_with_accepted_drafts_and_shrinks_after_misses():
    doc = list(range(100, 200))
    d = HistoryDrafter()
    remember(d, doc)
    ctx = [1, *doc[:10]]
    lengths = []
    for _ in range(5):  # the target keeps every drafted token (+ a bonus token)
        t = draft(d, ctx).tokens
        lengths.append(len(t))
        ctx = ctx + t + [doc[doc.index(t[-1]) + 1]]
    assert lengths == [10, 16, 16, 16, 16]  # max(4, 2 × run, match 10), capped by γ = 16
    t = draft(d, ctx).tokens
    ctx = ctx + t[:2] + [7]  # two kept, then the target disagrees: the run starts over
    assert len(draft(d, ctx + [doc[50], doc[51]]).tokens) == 4
    # first tokens wrong three times in a row: one token at a time, until one is right again
    d = HistoryDrafter()
    ctx = [5, 6, 70, 5, 6, 71, 5, 6, 72, 5, 6]
    for k in range(3):
        assert len(draft(d, ctx).tokens) >= 1
        ctx = ctx + [80 + k, 5, 6]  # the target never wrote what was drafted
    assert len(draft(d, ctx).tokens) == 1
    t = draft(d, ctx + [82, 83, 5, 6, 82]).tokens  # a right first token...
    assert len(draft(d, ctx + [82, 83, 5, 6, 82, t[0]]).tokens) > 1  # ...lifts the 1-token cap


# -- privacy switches -------------------------------------------------------------------------------


def test_clear_forgets_every_context():
    d = HistoryDrafter()
    remember(d, list(range(100, 140)))
    d.clear()
    assert d.indexed == 0
    assert draft(d, [1, 110, 111]).tokens == []


def test_remember_false_looks_at_the_current_context_only():
    d = HistoryDrafter(remember=False)
    remember(d, list(range(100, 140)))
    assert draft(d, [1, 110, 111]).tokens == []
    assert draft(d, [1, 110, 111, 112, 2, 110, 111]).tokens[0] == 112
    assert d.indexed == 7


def test_scopes_keep_separate_histories():
    a, b = list(range(100, 140)), list(range(200, 240))
    d = HistoryDrafter(corpus_tokens=[[30, 31, 32, 33]])
    d.use("alice")
    remember(d, a)
    d.use("bob")
    assert d.scope == "bob" and d.scopes == ["alice", "bob"]
    assert draft(d, [1, 110, 111]).tokens == []  # alice's text is not in bob's index
    assert draft(d, [1, 31, 32]).tokens == [33]  # the corpus is everyone's
    d.reset()
    remember(d, b)
    d.use("alice")
    assert draft(d, [1, 110, 111]).tokens == [112, 113, 114, 115]
    d.reset()
    assert draft(d, [1, 210, 211]).tokens == []
    d.reset()
    d.forget("bob")  # another scope, dropped whole
    d.use("bob")
    assert draft(d, [1, 210, 211]).tokens == []
    d.reset()
    d.use("alice")
    d.forget("alice")  # the current scope, cleared in place
    assert draft(d, [1, 110, 111]).tokens == []
    d.reset()
    remember(d, a)
    d.clear()  # every scope
    assert d.scopes == [None] and d.indexed == 5  # the corpus and its separator


def test_memory_bound_holds_across_scopes_and_evicts_the_least_recently_used():
    limit = 300
    d = HistoryDrafter(limit)
    docs = {s: [1000 * k + i for i in range(80)] for k, s in enumerate("abcd")}
    for s in "abc":  # three scopes of 81 tokens each: all fit
        d.use(s)
        remember(d, docs[s])
        assert d.indexed <= limit
    d.use("a")  # a is now the most recently used; b the least
    d.reset()
    d.use("d")
    for n in range(2, 81, 5):
        draft(d, docs["d"][:n])
        assert d.indexed <= limit
    d.reset()
    assert d.indexed <= limit and "b" not in d.scopes and {"a", "c", "d"} <= set(d.scopes)
    d.use("a")
    assert draft(d, [5, docs["a"][10], docs["a"][11]]).tokens[:2] == docs["a"][12:14]


def test_remember_can_be_switched_off_later():
    d = HistoryDrafter()
    remember(d, list(range(100, 140)))
    d.remember = False
    remember(d, [1, 2, 3])  # the next document ends: nothing is remembered from now on
    assert draft(d, [1, 110, 111]).tokens == [] and d.indexed == 3  # the current context only
    d.reset()
    big = [[5000 + 100 * k + i for i in range(60)] for k in range(10)]
    remember(d, *big)  # no earlier context comes back through a rebuild
    assert draft(d, [1, 110, 111]).tokens == []


def test_the_context_is_never_mutated():
    ctx = [1, 2, 3, 1, 2]
    d = HistoryDrafter()
    remember(d, [9, 1, 2, 4])
    snapshot = list(ctx)
    draft(d, ctx)
    draft(d, tuple(ctx))
    assert ctx == snapshot


# -- never worse than ngram ---------------------------------------------------------------------------


def _sequences():
    rnd = random.Random(7)
    for V in (2, 3, 5, 50):
        yield [rnd.randrange(V) for _ in range(150)]
    yield [0] * 150
    yield [0, 1] * 75
    yield [0, 1, 2, 0, 1, 3] * 25
    yield [rnd.choice([0, 0, 0, 1, 2]) for _ in range(150)]


@pytest.mark.parametrize("gamma", [1, 4, 15])
def test_drafts_whenever_ngram_does(gamma):
    for seq in _sequences():
        hist, ngram = HistoryDrafter(), NgramDrafter()
        for n in range(1, len(seq) + 1):
            ctx = seq[:n]
            if draft(ngram, ctx, gamma).tokens:
                assert draft(hist, ctx, gamma).tokens, (seq, n)
            else:
                draft(hist, ctx, gamma)


def test_same_first_token_as_ngram_when_repeats_are_in_the_context_only():
    rnd = random.Random(11)
    for _ in range(20):
        source = rnd.sample(range(10_000), 200)  # no token twice
        ctx, fresh = list(source), 10_000
        for start in rnd.sample(range(0, 200, 20), 6):  # disjoint segments copied once each
            ctx += source[start: start + rnd.randrange(3, 20)] + [fresh]
            fresh += 1
        hist, ngram = HistoryDrafter(), NgramDrafter()
        for n in range(1, len(ctx) + 1):
            h, g = draft(hist, ctx[:n]).tokens, draft(ngram, ctx[:n]).tokens
            assert bool(h) == bool(g) and h[:1] == g[:1], n


# -- registry -----------------------------------------------------------------------------------------


def test_registry_specs(tmp_path):
    target = ReferenceBackend(6)
    d = open_drafter("history", target)
    assert isinstance(d, HistoryDrafter) and d.max_tokens == 262_144 and d.indexed == 0
    assert open_drafter("history:5000", target).max_tokens == 5000
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abcdefedcba")
    d = open_drafter(f"history:5000@{corpus}", target)
    assert d.max_tokens == 5000 and d.indexed == 12  # 11 letters + the end of the document
    assert draft(d, [0, 4, 5]).tokens[:3] == [4, 3, 2]
    assert open_drafter(f"history@{corpus}", target).indexed == 12
    with pytest.raises(EdgespecError, match=r"^history corpus file .*missing\.txt not found$"):
        open_drafter(f"history@{tmp_path / 'missing.txt'}", target)
    for bad in ("history:", "history:12k", "history:1:2", "history@", "history:10"):
        with pytest.raises(EdgespecError, match="bad history drafter"):
            open_drafter(bad, target)


# -- losslessness -------------------------------------------------------------------------------------


@pytest.fixture
def fixed_costs(monkeypatch):
    """-k auto with known costs (as in test_lossless_reference), so that the scheduler speculates."""
    from edgespec import calibration as profile
    from edgespec.schedule.scheduler import CostModel

    monkeypatch.setattr(profile, "calibrate", lambda backend, ks=profile.CALIBRATION_KS, **kw: {
        k: 0.05 if tuple(ks) != profile.CALIBRATION_KS else 1 + 0.1 * (k - 1) for k in ks})  # a drafter: 0.05
    monkeypatch.setattr(profile, "context_cost", lambda backend, **kw: 0.0)
    monkeypatch.setattr(CostModel, "observe_verify", lambda self, *args: None)
    monkeypatch.setattr(CostModel, "observe_draft", lambda self, *args: None)


@pytest.mark.parametrize("gamma", [1, 3, 6, "auto"])
def test_greedy_spec_equals_plain_with_history(gamma, request):
    if gamma == "auto":
        request.getfixturevalue("fixed_costs")
    target = ReferenceBackend(6, seed=5)
    engine = Engine(target, HistoryDrafter(), num_draft=gamma)
    accepted = []
    for prompt in ["abcabcab", "fedcba", "abababab", "cafe", "abcabcab", "dabcabcabd", "fedcba"]:
        plain = engine.generate(prompt, max_tokens=96, speculative=False)
        spec = engine.generate(prompt, max_tokens=96)
        assert spec.tokens == plain.tokens, prompt
        accepted.append(spec.stats.n_accepted)
    assert sum(accepted) > 0
    if gamma != "auto":  # a prompt seen before: its whole reply is in the history
        assert accepted[4] > accepted[0] and accepted[6] > accepted[1]


def test_sampled_generation_runs():
    target = ReferenceBackend(6, seed=5)
    engine = Engine(target, HistoryDrafter(), num_draft=4)
    for seed in range(3):
        g = engine.generate("abcabc", max_tokens=64, temperature=0.8, seed=seed)
        assert len(g.tokens) == 64


def test_cost_is_microseconds():
    """A loose guard against an O(context) or O(history) regression (measured numbers: docs/history.md)."""
    rnd = random.Random(0)
    d = HistoryDrafter()
    docs = [[min(int(rnd.paretovariate(1.0)), 31_999) for _ in range(1000)] for _ in range(20)]
    t0 = time.perf_counter()
    remember(d, *docs)
    per_token = (time.perf_counter() - t0) / 20_000
    ctx = docs[3][:1500] + docs[7][:500]
    draft(d, ctx[:1000])
    t0 = time.perf_counter()
    for n in range(1001, 2001):
        draft(d, ctx[:n], 15)
    per_call = (time.perf_counter() - t0) / 1000  # includes slicing a 2k-token list per call
    assert per_token < 200e-6 and per_call < 1e-3, (per_token, per_call)


def test_a_long_periodic_run_keeps_drafting_its_period():
    """Past WALK repeats the counts of short states lag (bounded cost per token); drafts stay right."""
    d, ctx = HistoryDrafter(), []
    for tok in list(range(7)) * 100:
        ctx.append(tok)
        got = draft(d, ctx, 15).tokens
    assert got == [(ctx[-1] + 1 + i) % 7 for i in range(15)]
