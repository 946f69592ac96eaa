"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's
suffix n-gram (llama.cpp's ngram-simple, HF's prompt lookup). Deterministic, so q is one-hot."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgespec.drafters.base import Draft
from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree

MAX_SUPPORT = 16
SYNC_WINDOW = 64  # tokens compared to tell an extension of the indexed context from a new one


class NgramDrafter:
    """Tries suffix n-grams from `n_max` down to `n_min` tokens; the most recent match wins.
    No match drafts nothing, and the engine takes a plain step.

    An index (n-gram → where it last ended) grows with the context, so a call costs a few
    microseconds however long the context; a context that is not an extension of the last one
    (judged by its last SYNC_WINDOW indexed tokens) rebuilds it."""

    name = "ngram"
    paths: tuple[str, ...] = ()  # no model: drafting costs next to nothing
    sampled_trees = True  # deterministic trees (q None) at any temperature (drafters.base.prices_sampled_trees)

    def __init__(self, n_max: int = 4, n_min: int = 2) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram sizes need 1 <= n_min <= n_max (got n_min={n_min}, n_max={n_max})")
        self.n_max, self.n_min = n_max, n_min
        self._ctx: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram → latest end (exclusive) indexed

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        ctx = self._sync(context)
        L = len(ctx)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            e = self._last_end.get(tuple(ctx[L - n:]))
            if e is not None:
                m = n  # the match's full length (up to MAX_SUPPORT): longer ones copy more reliably
                while m < MAX_SUPPORT and e - m - 1 >= 0 and ctx[e - m - 1] == ctx[L - m - 1]:
                    m += 1
                return Draft(ctx[e: min(e + gamma, L)], support=m)
        return Draft([])

    def _sync(self, context: Sequence[int]) -> list[int]:
        """Extend the index to every n-gram that ends before the context's last position (the
        suffix itself is what gets looked up, so it must not find itself)."""
        n_old = len(self._ctx)
        # an extension agrees on the indexed tail: comparing the whole context would cost O(context)
        # per call; a context that matched only there could cost acceptance, never exactness
        w = min(n_old, SYNC_WINDOW)
        if len(context) < n_old or list(context[n_old - w: n_old]) != self._ctx[n_old - w:]:
            self._ctx, self._last_end, n_old = [], {}, 0
        ctx = self._ctx
        ctx.extend(int(t) for t in context[n_old:])
        for e in range(max(n_old - 1, 0), len(ctx) - 1):  # ends n_old-1 .. L-2 are new (end L-1 was the suffix)
            for n in range(self.n_min, min(self.n_max, e + 1) + 1):
                self._last_end[tuple(ctx[e + 1 - n: e + 1])] = e + 1
        return ctx

    def lookup(self, ctx: np.ndarray, gamma: int) -> list[int]:
        """The same answer by a scan of the whole context (the reference the index is tested on)."""
        L = ctx.shape[0]
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            suffix = ctx[L - n:]
            # starts s < L - n of windows ctx[s:s+n] equal to the suffix, checked one column at a time
            starts = np.flatnonzero(ctx[: L - n] == suffix[0])
            for j in range(1, n):
                starts = starts[ctx[starts + j] == suffix[j]]
            if starts.size:
                s = int(starts[-1]) + n  # continuation begins right after the match
                return ctx[s: min(s + gamma, L)].tolist()
        return []

    def draft_tree(self, context: Sequence[int], max_nodes: int, max_depth: int, params: SamplingParams,
                   rng: np.random.Generator, stop: Callable[[Sequence[float]], bool] | None = None) -> DraftTree:
        """The continuations of every earlier occurrence of the longest suffix n-gram that has one,
        most recent first, merged where they agree, up to max_nodes nodes: the first child at each
        level is what `draft` copies (the latest match, the tree's `chain`). A node's confidence is
        the share of the continuations through its parent that go on with its token. A scan of the
        context (O(context) a call)."""
        ctx = np.asarray(context, dtype=np.int64)
        L, tokens, parents, count = len(ctx), [], [], []
        kids: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            starts = np.flatnonzero(ctx[: L - n] == ctx[L - n])
            for j in range(1, n):
                starts = starts[ctx[starts + j] == ctx[L - n + j]]
            for s in starts[::-1] + n:  # continuations, latest first
                node = -1
                for t in ctx[s: min(s + max_depth, L)].tolist():
                    if (node, t) not in kids:
                        if len(tokens) == max_nodes:
                            break
                        kids[node, t] = len(tokens)
                        tokens.append(t)
                        parents.append(node)
                        count.append(0)
                    node = kids[node, t]
                    count[node] += 1
            if tokens:
                break
        through = [sum(count[c] for c in range(len(tokens)) if parents[c] == -1)] + count  # the root's, then each node's
        conf = [count[i] / max(1, through[par + 1]) for i, par in enumerate(parents)]
        return DraftTree(tokens, parents, confidence=conf,
                         chain_draft=self.draft(context, max_depth, params, rng) if tokens else None)

    def cost_prior(self, note: Callable[[str], None] | None = None) -> None:
        """None: a lookup costs microseconds, nothing the scheduler needs to price."""
        return None

    def reset(self) -> None:
        """Forget the index: the next call indexes its context from scratch. (Without this, a context
        that agreed with the indexed one on its last SYNC_WINDOW tokens would be taken for its
        extension, and drafted from the earlier context's n-grams: a server resets its drafter
        between clients, edgespec.server.isolation.)"""
        self._ctx, self._last_end = [], {}

    def close(self) -> None:
        pass
