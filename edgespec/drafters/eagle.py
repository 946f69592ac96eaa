"""EAGLE-3 drafting: a feature head proposes a chain of tokens from the target's own hidden states.

The pairing is llama.cpp's (common/speculative.cpp, 0.3.36), restated for edgespec's view of the
context: the committed context c_0..c_{N-1} (c_{N-1} is the pending token, not yet in the target's
KV cache) fills head positions P = 0..N-2 with the pairs (c_{P+1}, g_P), g_P = fc(target features of
position P). The pair at N-2 predicts x̃₁. Drafting on, position N-2+i takes (x̃ᵢ, h), h being the
head's own pre-norm output at the previous position (EAGLE-3's "test time"), and predicts x̃ᵢ₊₁.

Chain positions are never kept: after verification the target has features for the accepted tokens,
and the next call redoes those positions from them (llama.cpp's process() overwrites them the same
way). The head's KV cache is synced to each call's context by common prefix, like
DraftModelDrafter's, so partial rejection, full acceptance and new prompts need no special case.

Trees (`draft_tree`): EAGLE-2's dynamic tree (drafters.head_tree.dynamic_tree). Expanding a node runs
the head on the pair (its token, its parent's h) at head position N−2+depth, seeing the context's pairs
and its ancestors'. A runner with `decode_tree` (heads.eagle3_mlx on MLX, heads.eagle3_llama on libllama)
expands a whole depth in ONE step, as EAGLE-2 does: the nodes' pairs go in one batch at their own
positions, each seeing the context's and its ancestors' entries (every ancestor was expanded, so its pair
is held): on MLX by a mask in the batch axis, on libllama by one sequence id per node holding those cells
(heads.llama_head's tree entries). The numpy oracle branches by replay: a depth's nodes are expanded one
decode each, in path order, the cache truncated to the deepest ancestor the node shares with the
previous expansion and the rest of its path decoded again from the h kept per node (a sibling costs a
one-pair decode, a cousin a short replay): up to TOP_K head steps per depth instead of one. Either way
the tree's entries are dropped after drafting, leaving the head's cache as the context alone left it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from edgespec.drafters.base import Chain, Draft, DraftCost, HeadDrafter, common_prefix
from edgespec.drafters.head_tree import TOP_K, dynamic_tree, rank_dist
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams, process_rows
from edgespec.tree import DraftTree

F32 = npt.NDArray[np.float32]


class Eagle3Runner(Protocol):
    """What the drafter needs from a head: heads.eagle3_llama.LlamaEagle3Head (libllama),
    heads.eagle3_mlx.MlxEagle3Head (MLX), or the numpy oracle heads.eagle3.Eagle3Head (tests)."""

    n_embd: int
    n_embd_tgt: int
    n_vocab: int

    @property
    def n_past(self) -> int: ...

    def encode(self, features: F32) -> F32: ...

    def decode(self, tokens: Sequence[int], g: F32, rows: Literal["all", "last"] = "all") -> tuple[F32, F32]: ...

    def truncate(self, n_past: int) -> None: ...


class EagleDrafter(HeadDrafter):
    """Chain drafting with an EAGLE-3 head: greedy takes the head's argmax, sampling draws from the
    processed head distribution (sampling.process, as for the target) and returns those q rows.
    Constructed as HeadDrafter(head, target, path); `_ctx` is the context whose pairs fill head
    positions 0..len-2.
    """

    name = "eagle3"
    head: Eagle3Runner

    def sync(self, context: Sequence[int]) -> tuple[F32, F32] | None:
        """Bring the head's KV cache to `context` and return the logits (V,) and pre-norm h (1, H)
        of its last pair, i.e. the head's distribution of the token after `context`; None while the
        target has evaluated no position (a one-token context)."""
        n = len(context)
        if n < 2:
            return None
        if self.target.n_past < n - 1:
            raise EdgespecError(f"the EAGLE-3 drafter needs target features of the {n - 1} context tokens before "
                                f"the last, but the target has evaluated {self.target.n_past}")
        common = common_prefix(self._ctx, context)
        # unchanged pairs (never more than the head holds); the last is redone for fresh logits
        n_keep = max(0, min(common - 1, n - 2, self.head.n_past))
        self.head.truncate(n_keep)
        self._ctx = list(context[: n_keep + 1])
        g = self.head.encode(self.target.features(n_keep, n - 1))  # (n-1-n_keep, H)
        logits, h = self.head.decode(context[n_keep + 1:], g, rows="last")
        self._ctx = list(context)
        self._synced = n - 2 - n_keep  # pairs evaluated beyond the one every call needs
        return logits[0], h

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most `gamma` tokens after `context` (see drafters.base.Drafter)."""
        first = self.sync(context) if gamma > 0 else None
        if first is None:
            return Draft([])
        logits, h = first
        chain = Chain(params, rng, stop)  # q rows are zero outside the draft vocabulary
        while (x := chain.step(logits)) is not None and len(chain.tokens) < gamma:
            out, h = self.head.decode([x], h)
            logits = out[0]
        return chain.draft(self._synced)

    def draft_tree(self, context: Sequence[int], max_nodes: int, max_depth: int, params: SamplingParams,
                   rng: np.random.Generator, stop: Callable[[Sequence[float]], bool] | None = None,
                   top_k: int = TOP_K) -> DraftTree:
        """EAGLE-2's dynamic tree of at most `max_nodes` nodes and depth `max_depth` after `context`
        (drafters.head_tree.dynamic_tree: top_k nodes expanded per depth, top_k children each; greedy
        reranked by cumulative confidence, sampled drawn without replacement within a per-depth budget;
        confidences conditional; `stop` is not asked: the budget shapes the tree). See the module docstring
        for how the head's state branches."""
        first = self.sync(context) if max_nodes > 0 and max_depth > 0 else None
        if first is None:
            return DraftTree([], [])
        logits, h_root = first
        base = self.head.n_past  # the context's pairs; node at depth d sits at base + d − 1
        dist = rank_dist if params.greedy else (lambda z: process_rows(z[None], params)[0].dense())
        hs: dict[int, F32] = {}  # node → the pre-norm h of its pair (the g of its children's pairs)
        cached: list[int] = []  # replay: the nodes whose pairs the head holds from position base on, in path order
        entry: dict[int, int] = {}  # tree step: node → its pair's cache entry

        def replay(paths: list[list[int]], tokens: list[list[int]]) -> list[npt.NDArray[np.float64]]:
            nonlocal cached
            out = []
            for path, toks in zip(paths, tokens, strict=True):
                k = common_prefix(cached, path[:-1])
                self.head.truncate(base + k)
                g = np.concatenate([hs[path[j - 1]] if j > 0 else h_root for j in range(k, len(path))])
                z, hs[path[-1]] = self.head.decode(toks[k:], g, rows="last")
                cached = list(path)
                out.append(dist(z[0]))
            return out

        def step(paths: list[list[int]], tokens: list[list[int]]) -> list[npt.NDArray[np.float64]]:
            n, held = len(paths), self.head.n_past
            visible = np.zeros((n, held + n), bool)
            visible[:, :base] = True  # the context's pairs
            for r, path in enumerate(paths):
                visible[r, [entry[a] for a in path[:-1]]] = True  # its ancestors' pairs
                visible[r, held + r] = True  # itself
            g = np.concatenate([hs[p[-2]] if len(p) > 1 else h_root for p in paths])
            z, h = self.head.decode_tree([t[-1] for t in tokens], g, [base + len(p) - 1 for p in paths], visible)
            for r, path in enumerate(paths):
                entry[path[-1]], hs[path[-1]] = held + r, h[r:r + 1]
            return [dist(row) for row in z]

        expand = step if callable(getattr(self.head, "decode_tree", None)) else replay
        try:
            tree = dynamic_tree(dist(logits), expand, max_nodes=max_nodes, max_depth=max_depth,
                                sampled=not params.greedy, rng=rng, top_k=top_k)
        finally:
            self.head.truncate(base)
        # the first-child chain as a Draft (a prefix of draft()'s chain when greedy), each confidence known
        # before its token was drawn, as Draft's are: the top probability of the row it came from
        first = tree.first_chain()
        conf = [tree.confidence[i] if tree.q is None else float(tree.q[i].max()) for i in first]  # type: ignore[index]
        tree.chain_draft = Draft([tree.tokens[i] for i in first], None if tree.q is None else tree.q[first], conf,
                           self._synced)
        return tree

    def measure_ms_per_token(self, repeats: int = 8) -> float:
        """Median ms of one chain step (a one-pair decode and its argmax), timed on scratch positions
        that are rolled back: the scheduler's prior for this drafter's cost per draft token."""
        self._make_room(repeats + 1)
        n0 = self.head.n_past
        g = np.zeros((1, self.head.n_embd), np.float32)
        times = []
        try:
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                logits, g = self.head.decode([0], g)
                int(np.argmax(logits[0]))
                times.append(time.perf_counter() - t0)
        finally:
            self.head.truncate(n0)
        return 1000 * statistics.median(times[1:])  # the first call warms caches

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost:
        """The scheduler's prior: a chain of `measure_ms_per_token()` steps."""
        return DraftCost(0.0, self.measure_ms_per_token())
