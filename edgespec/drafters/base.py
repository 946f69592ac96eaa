"""The Drafter protocol: propose up to γ tokens after a context.

A drafter sees the whole committed context (prompt + generated tokens, the last one not yet
evaluated by the target) on every call, so it never depends on being told what was accepted:
a drafter with its own KV cache syncs it to the context by common prefix. A drafter bug can only
lower acceptance; verification keeps the output exact. The context is the engine's own list, lent
for the call (no O(context) copy per cycle): read it, copy what you keep, never mutate it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import Backend, FeatureBackend
from edgespec.sampling import SamplingParams, process_rows
from edgespec.tree import DraftTree


@dataclass
class Draft:
    tokens: list[int]  # x̃₁..x̃γ (may be empty: then the cycle is a plain step)
    q: npt.NDArray[np.float64] | None = None  # (γ, V) processed draft probabilities; None = one-hot
    # per token, the drafter's belief that it will be accepted, computed BEFORE the token is drawn
    # (e.g. max q). A rule that verifies x̃ᵢ or not depending on x̃ᵢ itself, such as q(x̃ᵢ), would
    # bias sampled output; one that depends only on what came before is lossless.
    confidence: list[float] | None = None
    synced: int = 0  # context tokens the drafter missed and caught up on before drafting
    copied: int = 0  # context tokens it took from the target's cache instead (KV handoff; then synced aren't read)
    support: int | None = None  # n-gram drafters: how many context tokens the match they copy spans

    def head(self, n: int) -> Draft:
        """The first n tokens of this draft (their q rows and confidences with them); itself when
        it has no more (the engine cuts every cycle's draft: no copy when nothing is cut)."""
        if n >= len(self.tokens):
            return self
        return replace(self, tokens=self.tokens[:n], q=None if self.q is None else self.q[:n],
                       confidence=None if self.confidence is None else self.confidence[:n])


def confidence(logits: npt.NDArray[np.float32], q: npt.NDArray[np.float64] | None) -> float:
    """A position's confidence, known before its token is drawn (see Draft.confidence): the top
    probability of q when sampling, of the raw softmax of `logits` when greedy (q None)."""
    return float(q.max()) if q is not None else float(1.0 / np.exp(logits - logits.max()).sum())


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (how much of a cache synced to `a` serves `b`).
    Drafters ask every cycle with the whole context, so slices are compared (C speed; each token
    once over the bisection): 2000 tokens take ~50 µs instead of ~150 µs token by token."""
    if type(a) is not type(b):  # a list slice never equals a tuple slice
        a, b = list(a), list(b)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; the first difference, if any, is before hi
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 16:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo + next(i for i, (x, y) in enumerate(zip(a[lo:hi], b[lo:hi])) if x != y)


def reusable_prefix(cached: Sequence[int], tokens: Sequence[int], backend: Backend) -> int:
    """How many of the `cached` tokens (what `backend` holds) it can keep for `tokens`: their common
    prefix, or 0 where a recurrent state would have to go back before its last checkpoint."""
    n = common_prefix(cached, tokens)
    if backend.recurrent and n < len(cached):
        at = backend.checkpoint_at
        return n if at is not None and n >= at else 0
    return n


class Chain:
    """A draft drawn position by position from a neural drafter's logits: greedy takes the argmax,
    sampling draws from the processed distribution (sampling.process, as for the target) and keeps
    those q rows."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator,
                 stop: Callable[[Sequence[float]], bool] | None) -> None:
        self.params, self.rng, self.stop = params, rng, stop
        self.tokens: list[int] = []
        self.rows: list[npt.NDArray[np.float64]] = []
        self.conf: list[float] = []

    def step(self, logits: npt.NDArray[np.float32], conf: float | None = None) -> int | None:
        """Draw the next token from `logits` (V,), or None when `stop` refuses this position (asked
        with its confidence: `conf`, or derived from the logits by `confidence`)."""
        p = None if self.params.greedy else process_rows(logits[None], self.params)[0]
        q = None if p is None else p.dense()  # (V,)
        self.conf.append(confidence(logits, q) if conf is None else conf)
        if self.stop is not None and self.stop(self.conf):
            self.conf.pop()
            return None
        x = int(np.argmax(logits)) if p is None else p.sample(self.rng)
        self.tokens.append(x)
        if q is not None:
            self.rows.append(q)
        return x

    def draft(self, synced: int) -> Draft:
        """The Draft drawn so far (q: (γ, V), None when greedy: one-hot)."""
        return Draft(self.tokens, np.stack(self.rows) if self.rows else None, self.conf, synced)


class Drafter(Protocol):
    name: str
    paths: tuple[str, ...]  # the model/head files it drafts with (none for n-gram lookup)

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most `gamma` tokens to follow `context`. A drafter with confidences calls
        `stop(confidences)` once it knows the next position's confidence and before drawing its
        token, and drafts no more when it returns True (the scheduler's marginal gain vs cost rule)."""
        ...

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost | None:
        """What drafting costs, measured once (the scheduler's prior; refined from the cycles it
        sees), or None for a drafter too cheap to price. May use the drafter's own caches; leaves
        them reset. `note` hears of timing that takes long."""
        ...

    def reset(self) -> None:
        """Forget any cached context (the next draft syncs from scratch)."""
        ...

    def close(self) -> None: ...


class TreeDrafter(Drafter, Protocol):
    """A drafter that can also propose a tree of alternatives (edgespec.tree.DraftTree)."""

    def draft_tree(self, context: Sequence[int], max_nodes: int, max_depth: int, params: SamplingParams,
                   rng: np.random.Generator, stop: Callable[[Sequence[float]], bool] | None = None) -> DraftTree:
        """Propose a tree of at most `max_nodes` nodes, none deeper than `max_depth`, to follow
        `context` (parent -1: the pending last token of `context`). Siblings are in the order they were drawn; greedy, the first child
        is the drafter's first choice. Sampled, a node's q row is the processed distribution it was
        drawn from before its earlier siblings were removed (siblings drawn without replacement;
        None: deterministic drafts), as DraftTree says. Confidences: each node's probability at its
        parent. `stop`: as for `draft`, may end a drafter's chain of first choices early (one that
        drafts its chain first, paying per token, asks it)."""
        ...


def can_draft_trees(drafter: Drafter | None) -> bool:
    return callable(getattr(drafter, "draft_tree", None))


def prices_sampled_trees(drafter: Drafter | None) -> bool:
    """Whether `--tree auto` may cut this drafter's SAMPLED trees (schedule.trees): they are side trees
    (DraftTree.side_leaves) or deterministic (q None). Other drafters' sampled trees would be drafted
    only to be dropped, so they draft chains then (the class attribute `sampled_trees`)."""
    return can_draft_trees(drafter) and bool(getattr(drafter, "sampled_trees", False))


@dataclass(frozen=True)
class DraftCost:
    """What drafting γ tokens costs: fixed_ms + γ·per_token_ms (γ > 0). A block drafter (`block`)
    computes all its rows in one forward before any confidence is known, so its cost is mostly fixed."""

    fixed_ms: float
    per_token_ms: float
    block: bool = False
    # a block drafter's most drafts per forward (B − 1); describes the drafter, not its price
    max_block: int | None = field(default=None, compare=False)
    # ms per context token a draft model pays to catch up (a batched read; None: not measured)
    catch_up_ms: float | None = None
    # ms per context token to take the target's whole cache instead (KV handoff; None: it cannot)
    copy_ms: float | None = None


class HeadRunner(Protocol):
    """What every feature-head runner has: a KV cache of head positions that can be rolled back,
    and close() (the libllama heads free native handles; numpy and MLX heads hold nothing)."""

    @property
    def n_past(self) -> int: ...

    def truncate(self, n_past: int) -> None: ...

    def close(self) -> None: ...


class HeadDrafter:
    """What the feature-head drafters (EagleDrafter, DFlashDrafter, DSparkDrafter) share: a head runner
    whose cache is synced to each call's context by common prefix, reading a target's features.

    Args:
        head: the head runner (its logits must span the target's vocabulary).
        target: the target whose features the head reads; the engine keeps its KV cache at the
            context minus the pending token.
        path: the head file (for `paths`; "" for an in-memory head).
    """

    name = "head"

    def __init__(self, head: HeadRunner, target: FeatureBackend, path: str = "") -> None:
        self.head, self.target = head, target
        self.paths = (path,) if path else ()
        self._ctx: list[int] = []  # the context tokens the head's cache was synced to
        self._synced = 0

    def _make_room(self, n: int) -> None:
        """Forget the cached context unless `n` more positions fit after it (timing on scratch
        positions; a libllama head's context is the target's size)."""
        if self.head.n_past + n > self.target.n_ctx:
            self.reset()

    def reset(self) -> None:
        """Forget the head's cached context."""
        self._ctx = []
        self.head.truncate(0)

    def close(self) -> None:
        self.head.close()
