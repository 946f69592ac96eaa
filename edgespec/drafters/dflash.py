"""DFlash drafting: a block-parallel head proposes up to B−1 tokens in one forward pass.

The pairing is llama.cpp's (common/speculative.cpp ``common_speculative_impl_draft_dflash``,
0.3.36), restated for edgespec's view of the context: the committed context c_0..c_{N-1}
(c_{N-1} is the pending token, not yet in the target's KV cache) fills head positions
P = 0..N-2 with the target's fused features f_P (injected as K/V). A draft of n ≤ B−1 tokens is
one block [c_{N-1}, MASK×n] at positions N-1..N-1+n, whose rows 1..n give the logits of
x̃₁..x̃ₙ (llama.cpp decodes n_max + 1 block tokens the same way). The rows are computed together,
so q_i depends on the context only, never on x̃_{<i}: sampling each x̃ᵢ from q_i and verifying
with those q rows is exact speculative sampling.

The head's cache is synced to each call's context by common prefix, like EagleDrafter's: rows of
positions whose tokens changed are dropped and re-injected from the target's features, so partial
rejection, full acceptance and new prompts need no special case. The block's own K/V never stay.

Trees (`draft_tree`, DDTree-style): the same block's chain plus, at each position, the next most likely
tokens of that position's row as side leaves, ranked by reach × probability to the node budget
(drafters.head_tree.block_tree over tree_draft.side_tree). No forward beyond the chain's block: a row's
alternatives are leaves, since the block has no rows after a token the chain did not draft. A side
leaf at row i shares its parent (the chain's token i−1) with the chain's token i, so DSpark's rows,
biased by that parent, are the right distribution for it too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from edgespec.drafters.base import Chain, Draft, DraftCost, HeadDrafter, common_prefix
from edgespec.drafters.head_tree import block_tree, rank_dist
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree

F32 = npt.NDArray[np.float32]


class DFlashRunner(Protocol):
    """What the drafter needs from a head: heads.dflash_llama.LlamaDFlashHead (libllama),
    heads.dflash_mlx.MlxDFlashHead (MLX), or the tests' numpy oracle (tests/head_oracles.py)."""

    @property
    def n_past(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def inject(self, features: F32) -> Any: ...

    def truncate(self, n_past: int) -> None: ...

    def block_tokens(self, anchor: int, n: int | None = None) -> list[int]: ...

    def block_logits(self, tokens: Sequence[int]) -> F32: ...


class DFlashDrafter(HeadDrafter):
    """Block drafting with a DFlash head: greedy takes each block row's argmax, sampling draws each
    position from its processed distribution (sampling.process, as for the target) and returns
    those q rows. Constructed as HeadDrafter(head, target, path); `_ctx` holds the tokens of head
    positions 0..n_past-1.
    """

    name = "dflash"
    head: DFlashRunner
    sampled_trees = True  # block_tree: side trees (drafters.base.prices_sampled_trees)

    def sync(self, context: Sequence[int]) -> None:
        """Bring the head's context cache to the features of `context` minus its last token."""
        n = len(context) - 1
        if self.target.n_past < n:
            raise EdgespecError(f"the DFlash drafter needs target features of the {n} context tokens before "
                                f"the last, but the target has evaluated {self.target.n_past}")
        keep = max(0, min(common_prefix(self._ctx, context), n, self.head.n_past))
        self.head.truncate(keep)
        self._ctx = list(context[:keep])
        if keep < n:
            self.head.inject(self.target.features(keep, n))
        self._ctx = list(context[:n])
        self._synced = max(0, n - keep - 1)  # rows beyond the one a cycle normally adds

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most min(`gamma`, B−1) tokens after `context` (see drafters.base.Drafter)."""
        n = min(gamma, self.head.block_size - 1)
        if n <= 0 or not context:
            return Draft([])
        self.sync(context)
        row = self._rows(context[-1], n)
        chain, prev = Chain(params, rng, stop), context[-1]
        for i in range(n):
            x = chain.step(*row(i, prev))
            if x is None:
                break
            prev = x
        return chain.draft(self._synced)

    def draft_tree(self, context: Sequence[int], max_nodes: int, max_depth: int, params: SamplingParams,
                   rng: np.random.Generator, stop: Callable[[Sequence[float]], bool] | None = None) -> DraftTree:
        """The block's chain of min(max_depth, max_nodes, B−1) drafts after `context` and the alternatives
        its rows rank next, up to `max_nodes` in all (module docstring; confidences conditional)."""
        n = min(max_depth, max_nodes, self.head.block_size - 1)
        if n <= 0 or not context:
            return DraftTree([], [])
        self.sync(context)
        row = self._rows(context[-1], n)
        chain, prev, dists = Chain(params, rng, None), context[-1], []
        for i in range(n):
            logits, conf = row(i, prev)
            prev = chain.step(logits, conf)
            assert prev is not None  # no stop rule
            dists.append(rank_dist(logits) if params.greedy else chain.rows[-1])
        q = np.stack(chain.rows) if chain.rows else None
        tree = block_tree(chain.tokens, dists, max_nodes, q, rng)
        tree.chain_draft = chain.draft(self._synced)  # the first-child chain, as draft() draws it (its confidences)
        return tree

    def _rows(self, anchor: int, n: int) -> Callable[[int, int], tuple[F32, float | None]]:
        """Run the block of `n` drafts after `anchor`; returns row(i, prev): the logits (V,) of draft
        i (0-based) given the token drafted before it, and the head's own confidence in it (None:
        derived from the logits by drafters.base.confidence). DFlash's rows ignore prev."""
        rows = self.head.block_logits(self.head.block_tokens(anchor, n + 1))[1:]  # (n, V)
        return lambda i, prev: (rows[i], None)

    def measure_ms_per_token(self, repeats: int = 8) -> float:
        """The median ms of a block of g + 1 tokens and its argmaxes, divided by its g drafts,
        g = min(4, B−1) (the scheduler's slow start; a block's cost grows slowly with g, so this
        overestimates longer drafts: the scheduler uses `measure_draft_cost`)."""
        g = min(4, self.head.block_size - 1)
        return self._time_block(g, repeats) / g

    def measure_draft_cost(self, repeats: int = 8) -> DraftCost:
        """The scheduler's prior: a block of γ drafts costs fixed + γ·per_token ms, the line through
        the median times of blocks of 1 and B−1 drafts (one forward either way: mostly fixed)."""
        g = self.head.block_size - 1
        one = self._time_block(1, repeats)
        per_token = max(0.0, (self._time_block(g, repeats) - one) / (g - 1)) if g > 1 else 0.0
        return DraftCost(max(0.0, one - per_token), per_token, block=True, max_block=g)

    def _time_block(self, g: int, repeats: int) -> float:
        """Median ms of a block of g + 1 tokens and its argmaxes, timed after the cached context;
        the block leaves the cache as it was."""
        self._make_room(g + 1)
        tokens = self.head.block_tokens(0, g + 1)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            self.head.block_logits(tokens)[1:].argmax(axis=1)
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times[1:])  # the first call warms caches

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost:
        """The scheduler's prior: `measure_draft_cost()` (one block forward: mostly fixed)."""
        return self.measure_draft_cost()
