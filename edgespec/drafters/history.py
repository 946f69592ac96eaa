"""History lookup: draft what followed the longest earlier match of the context's suffix, in the
current context, in the contexts this drafter saw before (earlier generations and server requests)
and in an optional corpus; the most frequent continuation wins, the most recent breaks ties.
Deterministic, so q is one-hot, and model-free, so the scheduler drafts it in shadow (cost_prior None).

Upstream read first (facts carried over, no code):
- SuffixDecoding (arXiv 2411.04975), snowflakedb/ArcticInference @9d4643881608178f0f58a33d1b61919ca246997f,
  csrc/suffix_decoding/suffix_tree.{h,cc} and arctic_inference/suffix_decoding/cache.py: a global
  suffix tree over previous responses plus a per-request tree over prompt and output (depth capped
  at 64); node counts = suffixes through the node; a draft walks the highest-count child with
  prob *= child/parent count, stops below min_token_prob (0.1) and is at most
  max_spec_factor (1.0) × match length + offset; oldest cached responses evicted first (FIFO).
- llama.cpp (ggml-org/llama.cpp): common/ngram-mod.cpp @7f52bcafebebe0165f9ff5db017208fb1b190784 and
  docs/speculative.md @a71f4a0e1db40fef856d8124fc54c1ff3e1a9095 (ngram-mod: an LCG hash of each
  n-gram → the token that followed it, one ~16 MB pool shared by every slot and request, a draft
  rolled forward token by token; a later speculative.cpp, read in a fork's copy, stops at the first
  miss, drops drafts shorter than n_min and resets the pool after 3 low-acceptance rounds);
  common/ngram-map.cpp @6870ab7e4d741fffc218dd5d370427d81ab17630 (ngram-map-k: a key's draft is
  capped by how many tokens the target accepted of its last draft; k4v drafts the most frequent
  value only when it is seen twice as often as the others); common/speculative.cpp
  @6c8a04576e2cfa04261019fe8cbdc90c5cfc90fb (the implementations, one state each).

Here one suffix automaton (Blumer et al. 1985, built online) indexes everything: the corpus, the
earlier contexts (each ended by a separator token of its own, so no match crosses two documents)
and the current context, so the longest earlier match of the context's suffix is the suffix link
of the last state: O(1), however long the history. Per state it keeps the number of occurrences,
the latest one and the most frequent next token (updated as tokens are added; ties go to the token
seen last, which is the most recent continuation), so a draft costs a few array reads per token.
Every call gets the whole committed context; one that does not extend the previous one starts a
new document, and the previous context stays indexed as history (unless remember=False). The same
comparison shows which of the last draft's tokens the target kept, which sets the draft length.

A call costs microseconds (indexing one token and drafting 15: ~15 µs on a 2-core CPU) and the index
~170 bytes per token (~44 MiB at the default 256k tokens): docs/history.md has the measurements.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from edgespec.drafters.base import Draft
from edgespec.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 262_144  # tokens indexed at most (corpus + history + current context)
KEEP = 0.75  # an eviction keeps the newest documents up to this share of the limit (amortises rebuilds)
SYNC_WINDOW = 64  # tokens compared to tell an extension of the indexed context from a new one
ALPHA = 2.0  # a draft is at most ALPHA × the match length (SuffixDecoding's max_spec_factor)
MIN_MATCH = 2  # shortest suffix match drafted from (ngram's n_min)
MIN_PROB = 0.1  # stop once the walk's estimated probability falls below this (SuffixDecoding's default)
SLOW_START = 4  # at most max(SLOW_START, 2 × run of right draft tokens) are drafted...
MISSES = 3  # ...and 1 after this many drafts in a row whose first token was wrong
WALK = 64  # suffix-link steps updated per indexed token (bounds the cost of a long periodic run)
_STATE = ("_sam", "_docs", "_ctx", "_skip", "_prev", "_run", "_misses")  # one scope's index and counters
NONE, MULTI = -1, -2  # `tok` codes: no transition; transitions in `multi`. Separators are <= -3


class SuffixAutomaton:
    """The suffix automaton of one token sequence, grown one token at a time. State v stands for
    the substrings sharing one set of end positions: the longest is ln[v] tokens long, link[v] is
    the state of its longest suffix with more ends. Per state: occ (number of ends), end (the latest),
    best (the most frequent next token, NONE if none; ties: the latest), nbest (its count) and total
    (next tokens counted), updated along at most WALK suffix links per token: exact unless a short
    pattern repeats more than WALK times in a row (then short states' counts lag; drafts stay valid).
    Arrays of int32 plus a dict per branching state: ~170 bytes per token."""

    def __init__(self) -> None:
        i32 = "i"
        self.text = array(i32)
        self.ln, self.link, self.occ, self.end = array(i32, [0]), array(i32, [-1]), array(i32, [0]), array(i32, [-1])
        self.best, self.nbest, self.total = array(i32, [NONE]), array(i32, [0]), array(i32, [0])
        self.tok, self.to = array(i32, [NONE]), array(i32, [0])  # a single transition, inline
        self.multi: dict[int, dict[int, int]] = {}  # the transitions of states with several
        self.last = 0  # the state of the whole text
        self.next_sep = -3

    def copy(self) -> SuffixAutomaton:
        other = SuffixAutomaton.__new__(SuffixAutomaton)
        for k in ("text", "ln", "link", "occ", "end", "best", "nbest", "total", "tok", "to"):
            setattr(other, k, getattr(self, k)[:])
        other.multi = {v: dict(d) for v, d in self.multi.items()}
        other.last, other.next_sep = self.last, self.next_sep
        return other

    def __len__(self) -> int:
        return len(self.text)

    def separate(self) -> None:
        """End a document: a token of its own that no match can cross."""
        self.extend((self.next_sep,))
        self.next_sep -= 1

    def step(self, v: int, c: int) -> int:
        """The transition from v on token c (-1: none)."""
        t = self.tok[v]
        if t == c:
            return self.to[v]
        return self.multi[v].get(c, -1) if t == MULTI else -1

    def extend(self, tokens: Iterable[int]) -> None:
        text, ln, link, occ, end = self.text, self.ln, self.link, self.occ, self.end
        best, nbest, total, tok, to, multi = self.best, self.nbest, self.total, self.tok, self.to, self.multi
        last = self.last
        zeros, nones = (link, occ, nbest, total, to), (best, tok)
        for c in tokens:
            i = len(text)
            text.append(c)
            cur = len(ln)
            ln.append(ln[last] + 1)
            end.append(i)
            for a in zeros:
                a.append(0)
            for a in nones:
                a.append(NONE)
            p = last
            while p != -1:  # states of suffixes never followed by c: add the transition to cur
                t = tok[p]
                if t == c or (t == MULTI and c in multi[p]):
                    break
                if t == NONE:
                    tok[p], to[p] = c, cur
                elif t == MULTI:
                    multi[p][c] = cur
                else:
                    multi[p], tok[p] = {t: to[p], c: cur}, MULTI
                p = link[p]
            if p != -1:
                q = to[p] if tok[p] == c else multi[p][c]
                if ln[p] + 1 == ln[q]:
                    link[cur] = q
                else:  # split q: the clone keeps its shorter strings, which now also end at i
                    clone = len(ln)
                    ln.append(ln[p] + 1)
                    for a in (link, occ, end, best, nbest, total, tok, to):
                        a.append(a[q])
                    if tok[q] == MULTI:
                        multi[clone] = dict(multi[q])
                    while p != -1:
                        if tok[p] == c and to[p] == q:
                            to[p] = clone
                        elif tok[p] == MULTI and multi[p].get(c) == q:
                            multi[p][c] = clone
                        else:
                            break
                        p = link[p]
                    link[q] = link[cur] = clone
            v, n = cur, WALK  # cur and its suffix links: the states that gain end i
            while v > 0 and n:
                occ[v] += 1
                end[v] = i
                v, n = link[v], n - 1
            if c >= 0:  # the old last state and its suffix links were followed by c once more
                p, n = last, WALK
                while p > 0 and n:
                    k = occ[to[p] if tok[p] == c else multi[p][c]]
                    total[p] += 1
                    if k >= nbest[p]:
                        best[p], nbest[p] = c, k
                    p, n = link[p], n - 1
            last = cur
        self.last = last

    def walk(self, v: int, limit: int, min_match: int, min_prob: float) -> list[int]:
        """Up to `limit` tokens from state v: the most frequent next token each time, while the
        product of their frequencies stays >= min_prob (the first is always taken). A state with
        no next token (the end of the text) falls back to its suffix link, so a periodic
        context rolls forward."""
        best, nbest, total, ln, link, tok, to = self.best, self.nbest, self.total, self.ln, self.link, self.tok, self.to
        out: list[int] = []
        prob = 1.0
        while len(out) < limit:
            while best[v] == NONE and v > 0 and ln[link[v]] >= min_match:
                v = link[v]
            c = best[v]
            if c == NONE:
                break
            prob *= nbest[v] / total[v]
            if out and prob < min_prob:
                break
            out.append(c)
            v = to[v] if tok[v] == c else self.multi[v][c]
        return out


class HistoryDrafter:
    """Drafts the most frequent continuation of the longest earlier match (≥ min_match tokens) of
    the context's suffix, found in the current context, the earlier contexts (remember=True) and
    `corpus_tokens`; up to min(γ, alpha × match length, max(SLOW_START, 2 × the run of right
    draft tokens, the match length)), 1 after MISSES wrong first tokens in a row (a long match is the
    same evidence as a run of right drafts, and a miss does not reset it: the scheduler's streak).

    Args:
        max_tokens: most tokens indexed (corpus included); beyond it the oldest contexts are evicted
            (the index is rebuilt from the newest, down to KEEP of the limit).
        corpus_tokens: token id sequences indexed for good (at most max_tokens // 2 tokens in all).
        remember: False: index the current context only (n-gram lookup with counts) and the corpus.
            Settable at any time; the next document starts without history.
        alpha: a draft is at most alpha × the match length.
        min_match: shortest suffix match drafted from.
    """

    name = "history"
    paths: tuple[str, ...] = ()  # no model: drafting costs next to nothing

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, *, corpus_tokens: Iterable[Sequence[int]] = (),
                 remember: bool = True, alpha: float = ALPHA, min_match: int = MIN_MATCH) -> None:
        if max_tokens < 64:
            raise ValueError(f"max_tokens must be at least 64 (got {max_tokens})")
        if alpha <= 0 or min_match < 1:
            raise ValueError(f"need alpha > 0 and min_match >= 1 (got alpha={alpha}, min_match={min_match})")
        self.max_tokens, self.remember, self.alpha, self.min_match = max_tokens, remember, alpha, min_match
        base = SuffixAutomaton()
        for doc in corpus_tokens:
            if doc:
                base.extend(int(t) for t in doc)
                base.separate()
        if len(base) > max_tokens // 2:
            raise ValueError(f"the corpus has {len(base)} tokens, more than half of max_tokens={max_tokens}")
        self._base = base if len(base) else None  # kept pristine: clear() and rebuilds start from a copy
        self.clear()

    @property
    def indexed(self) -> int:
        """Tokens indexed now, every scope's (corpus, history, current context, one separator per
        document): at most max_tokens."""
        return len(self._sam) + self._others

    @property
    def scope(self) -> Hashable:
        """The scope whose index drafts now (see `use`)."""
        return self._scope

    @property
    def scopes(self) -> list[Hashable]:
        """Every scope that remembers something, least recently used first, then the current one."""
        return [*self._stores, self._scope]

    def use(self, scope: Hashable) -> None:
        """Draft from, and remember into, `scope`'s own index from now on (a new scope starts with the
        corpus only): a server gives each client one, so that no client's drafts, nor their timing,
        come from another's text. The current document ends; the other scopes' indexes are kept, and
        their tokens count toward max_tokens (the least recently used scope is evicted first)."""
        if scope == self._scope:
            return
        self._end_document()
        if self._docs:  # a scope that remembers nothing is not kept
            self._stores[self._scope] = tuple(getattr(self, k) for k in _STATE)
            self._others += len(self._sam)
        self._scope = scope
        stored = self._stores.pop(scope, None)
        if stored is None:
            self._fresh()
        else:
            self._others -= len(stored[0])
            for k, v in zip(_STATE, stored):
                setattr(self, k, v)

    def forget(self, scope: Hashable) -> None:
        """Forget every context `scope` saw (the corpus stays); the current scope is cleared in place."""
        if scope == self._scope:
            self._fresh()
        elif scope in self._stores:
            self._others -= len(self._stores.pop(scope)[0])

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        self._sync(context)
        sam = self._sam
        v = sam.link[sam.last] if len(self._ctx) > self._skip else -1
        while v > 0 and sam.best[v] == NONE:  # only followed by a document's end: a shorter match
            v = sam.link[v]
        m = sam.ln[v] if v > 0 else 0
        tokens: list[int] = []
        if m >= self.min_match and gamma > 0:
            tokens = sam.walk(v, min(gamma, max(1, int(self.alpha * m)), self.cap(m)), self.min_match, MIN_PROB)
        self._prev = tokens
        return Draft(tokens, support=m if tokens else None)

    def cap(self, match: int) -> int:
        """The longest draft recent acceptance and a `match`-token match allow (the class docstring)."""
        return 1 if self._misses >= MISSES else max(SLOW_START, 2 * self._run, match)

    def cost_prior(self, note: Callable[[str], None] | None = None) -> None:
        """None: a lookup costs microseconds, nothing the scheduler needs to price."""
        return None

    def reset(self) -> None:
        """End the current document: the next call starts a new one (the history stays)."""
        self._end_document()

    def clear(self) -> None:
        """Forget every context seen, in every scope (the corpus stays)."""
        self._stores: OrderedDict[Hashable, tuple] = OrderedDict()  # the other scopes' state, LRU first
        self._others = 0  # tokens indexed by the other scopes
        self._scope: Hashable = None
        self._fresh()

    def _fresh(self) -> None:
        """An empty history (the corpus only) for the current scope."""
        self._sam = self._base.copy() if self._base is not None else SuffixAutomaton()
        self._docs: list[array] = []  # earlier contexts still indexed, oldest first (for rebuilds)
        self._ctx: list[int] = []  # the current context (a copy)
        self._skip = 0  # its leading tokens left out of the index (a context longer than the limit)
        self._prev: list[int] = []  # the last draft, scored against the tokens that follow it
        self._run = self._misses = 0

    def close(self) -> None:
        self.clear()

    # -- internals --------------------------------------------------------------------------------

    def _sync(self, context: Sequence[int]) -> None:
        """Index the tokens the context adds; a context that does not extend the last one (judged by
        its last SYNC_WINDOW tokens, as NgramDrafter does) starts a new document."""
        n_old = len(self._ctx)
        w = min(n_old, SYNC_WINDOW)
        if len(context) < n_old or list(context[n_old - w: n_old]) != self._ctx[n_old - w:]:
            self._end_document()
            n_old = 0
        new = [int(t) for t in context[n_old:]]
        self._score(new)
        self._ctx.extend(new)
        if self._room(len(new)):
            self._sam.extend(new)
        else:
            self._rebuild()

    def _score(self, new: list[int]) -> None:
        """Learn from the tokens that followed the last draft: the run of right draft tokens, and
        whether its first token was wrong."""
        prev, self._prev = self._prev, []
        if not prev or not new:
            return
        k = 0
        while k < len(prev) and k < len(new) and prev[k] == new[k]:
            k += 1
        if k < len(prev) and k < len(new):  # the target emitted something else at position k
            self._run, self._misses = 0, self._misses + 1 if k == 0 else 0
        else:
            self._run, self._misses = self._run + k, 0

    def _end_document(self) -> None:
        ctx, skip = self._ctx, self._skip
        self._ctx, self._skip, self._prev, self._run, self._misses = [], 0, [], 0, 0
        if not ctx:
            return
        if not self.remember:
            self._fresh()
            return
        self._docs.append(array("i", ctx[skip:]))
        if self._room(1):
            self._sam.separate()
        else:
            self._rebuild()

    def _room(self, n: int) -> bool:
        """Whether n more tokens fit under max_tokens, once the least recently used other scopes are
        evicted as far as needed (False: the current scope must evict its own oldest, `_rebuild`)."""
        while self._stores and len(self._sam) + n + self._others > self.max_tokens:
            self._others -= len(self._stores.popitem(last=False)[1][0])
        return len(self._sam) + n + self._others <= self.max_tokens

    def _rebuild(self) -> None:
        """Evict the oldest contexts (then the current context's oldest tokens) down to KEEP of the
        limit and index what is left afresh."""
        base = self._base.copy() if self._base is not None else SuffixAutomaton()
        budget = int(self.max_tokens * KEEP) - len(base)
        self._skip = max(self._skip, len(self._ctx) - budget)
        room, keep = budget - (len(self._ctx) - self._skip), 0
        for doc in reversed(self._docs):
            if len(doc) + 1 > room:
                break
            room, keep = room - len(doc) - 1, keep + 1
        self._docs = self._docs[len(self._docs) - keep:]
        for doc in self._docs:
            base.extend(doc)
            base.separate()
        base.extend(self._ctx[self._skip:])
        self._sam = base
