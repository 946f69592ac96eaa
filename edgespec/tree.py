"""Verification of a draft TREE against the target's logits (issue #50). Pure numpy.

A tree holds n draft nodes below a root; the root is the pending last committed token, which the
target evaluates first. Row 0 of `logits` is the target's next-token logits after the root, row i+1
after node i (its context: the root, then the tokens of `path(i)`), so there are n+1 rows; one
forward pass computes them all under `attention_mask()` at `positions(n_past)`. A chain is the
width-1 tree (`DraftTree.chain`), so chains and trees share one code path.

Each function returns (path, next_token): the accepted node indices from the root's child down,
and the token emitted after them (the correction where the walk stopped, or the bonus after a
leaf). The emitted tokens are the path's tokens followed by next_token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.sampling import Dist, SamplingParams, process_rows, sample


@dataclass(eq=False)  # identity: q is an array
class DraftTree:
    """n draft nodes in topological order (each node's parent comes before it).

    `tokens[i]` is node i's token, `parents[i]` its parent's index (-1: the root). Siblings carry
    distinct tokens and are tried in index order, which must be the order they were drawn in.
    `q` (n, V), or None for deterministic drafts (each node's q one-hot at its token): row i is the
    processed draft distribution node i was drawn from BEFORE the tokens of its earlier siblings were
    removed. Drafting siblings without replacement from one distribution repeats that distribution
    (the drafter's at the parent) in every sibling's row; verification removes the earlier siblings'
    tokens and renormalises. `confidence` (n,) is the drafter's probability of each node's token at
its parent (the softmax at the parent's position; greedy: what the pricing of trees calibrates and
multiplies along paths, schedule.trees), carried along.
    """

    tokens: list[int]
    parents: list[int]
    q: npt.NDArray[np.float64] | None = None
    confidence: list[float] | None = None
    chain_draft: Any = None  # the chain Draft (drafters.base) the drafter drew first, if any: its cost fields
    # the chain of first children was drawn whole first, then every other node, a leaf beside a chain
    # node, each position's siblings in draw order (drafters.tree_draft.side_tree): a sampled tree
    # like this may be cut to a prefix of each position's siblings by a rule that reads only the chain
    side_leaves: bool = False
    depth: list[int] = field(init=False, repr=False)  # root's children: 1
    _children: list[list[int]] = field(init=False, repr=False)  # index 0: the root's, i+1: node i's

    def __post_init__(self) -> None:
        self.tokens, self.parents = [int(t) for t in self.tokens], [int(p) for p in self.parents]
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"DraftTree: {n} tokens but {len(self.parents)} parents")
        if self.confidence is not None and len(self.confidence) != n:
            raise ValueError(f"DraftTree: {n} tokens but {len(self.confidence)} confidences")
        self.depth, self._children = [], [[] for _ in range(n + 1)]
        seen: dict[tuple[int, int], int] = {}
        for i, (t, par) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= par < i:
                raise ValueError(f"DraftTree: node {i}'s parent {par} is not -1 (the root) or earlier")
            if t < 0:
                raise ValueError(f"DraftTree: node {i}'s token {t} is negative")
            j = seen.setdefault((par, t), i)
            if j != i:
                raise ValueError(f"DraftTree: nodes {j} and {i} are siblings with the same token {t}")
            self.depth.append(1 if par < 0 else self.depth[par] + 1)
            self._children[par + 1].append(i)
        if self.q is not None:
            self.q = np.asarray(self.q, dtype=np.float64)
            if self.q.ndim != 2 or self.q.shape[0] != n:
                raise ValueError(f"DraftTree: q has shape {self.q.shape}, expected ({n}, n_vocab)")
            bad = [i for i, t in enumerate(self.tokens) if t >= self.q.shape[1] or not self.q[i, t] > 0]
            if bad:
                raise ValueError(f"DraftTree: node {bad[0]}'s token {self.tokens[bad[0]]} has no probability "
                                 f"in its q row, so it cannot have been drawn from it")

    @classmethod
    def chain(cls, tokens: Sequence[int], q: npt.NDArray[np.float64] | None = None,
              confidence: Sequence[float] | None = None) -> DraftTree:
        """The width-1 tree x̃₁ → x̃₂ → …: node i's parent is node i-1 (q: verify.verify_stochastic's)."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), q,
                   None if confidence is None else list(confidence))

    @property
    def n_nodes(self) -> int:
        return len(self.tokens)

    def children(self, i: int) -> list[int]:
        """The children of node i (i = -1: the root's), in index order."""
        return self._children[i + 1]

    def path(self, i: int) -> list[int]:
        """Node indices from the root's child down to node i ([] for i = -1)."""
        return node_path(self.parents, i)

    def first_chain(self) -> list[int]:
        """Node indices of the chain of first children from the root down (what a chain drafter of
        the same draft would have proposed)."""
        out, kids = [], self.children(-1)
        while kids:
            out.append(kids[0])
            kids = self.children(kids[0])
        return out

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """The tree of the nodes `keep` (each one's parent kept too, or -1), in their index order."""
        keep = sorted(keep)
        if len(keep) == self.n_nodes:
            return self
        new = {old: k for k, old in enumerate(keep)}
        parents = [-1 if self.parents[i] < 0 else new[self.parents[i]] for i in keep]
        return DraftTree([self.tokens[i] for i in keep], parents, None if self.q is None else self.q[keep],
                         None if self.confidence is None else [self.confidence[i] for i in keep])

    def attention_mask(self) -> npt.NDArray[np.bool_]:
        """(n+1, n+1) bool; row/column 0 is the root, i+1 node i. [a, b] is True iff b is a or one of
        a's ancestors: each node attends to its own path only."""
        n = self.n_nodes
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[0, 0] = True
        for i, par in enumerate(self.parents):
            mask[i + 1] = mask[par + 1]
            mask[i + 1, i + 1] = True
        return mask

    def positions(self, n_past: int) -> npt.NDArray[np.int64]:
        """The position of each of the n+1 rows: the root at n_past, node i at n_past + depth[i]."""
        return np.array([n_past, *(n_past + d for d in self.depth)], dtype=np.int64)


def node_path(parents: Sequence[int], i: int) -> list[int]:
    """Node indices from the root's child down to node i under `parents` (-1: the root; [] for i = -1)."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def verify_tree_greedy(logits: npt.NDArray[np.floating], tree: DraftTree) -> tuple[list[int], int]:
    """From the root: take the current row's argmax; move to the child carrying it, or stop and emit it.
    Rows are read only along the walk. A chain gives verify.verify_greedy's result."""
    _check_rows(logits, tree)
    path, node = [], -1
    while True:
        t = int(np.argmax(logits[node + 1]))
        node = next((c for c in tree.children(node) if tree.tokens[c] == t), None)
        if node is None:
            return path, t
        path.append(node)


def verify_tree_stochastic(
    logits: npt.NDArray[np.floating],  # (n+1, V) target logits
    tree: DraftTree,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings drafted without replacement (RSD: Jeon et al. 2024,
    arXiv 2402.14160; multi-candidate verification as in SpecInfer, Miao et al. 2024, arXiv 2305.09781).

    At the current node, with p its processed target row (process_rows, as verify_stochastic), try
    its children in order: child j with token x drawn from q_j (its q row with the earlier siblings'
    tokens zeroed, renormalised; one-hot for deterministic drafts) is accepted with probability
    min(1, p(x)/q_j(x)), and the walk moves to it; on rejection p ← norm(max(p − q_j, 0)) (one-hot:
    p with x zeroed, renormalised) and the next child is tried. When all are rejected, or the node
    has none, next_token is sampled from the final p. For a chain this is verify_stochastic, draw
    for draw from the same rng.

    Lossless, by induction over the siblings from the last (whose residual is sampled directly): if
    the tries after child j emit a token distributed as their p' = norm(max(p − q_j, 0)), try j emits
    y with probability min(p, q_j)(y) + (1 − Σ min(p, q_j))·p'(y) = p(y), because x ~ q_j given the
    earlier siblings (the rejection lemma). So each node emits a token distributed as its p; a child's
    subtree was drafted from its path alone, independently of the verification's draws, so the walk
    goes on from the accepted child as plain sampling would.
    """
    _check_rows(logits, tree)
    rows = process_rows(logits, params)  # built on access: only the rows the walk reaches
    path, node = [], -1
    while True:
        child, token = _choose(rows[node + 1], tree, tree.children(node), rng)
        if child is None:
            return path, token
        path.append(child)
        node = child


def _choose(p: Dist, tree: DraftTree, kids: list[int], rng: np.random.Generator) -> tuple[int | None, int]:
    """One node of the walk: (the accepted child, its token), or (None, the token sampled from the
    residual left after every child was rejected)."""
    r: npt.NDArray[np.float64] | None = None  # the residual, dense, once a rejection changed p
    for j, c in enumerate(kids):
        x = tree.tokens[c]
        q_j = None if tree.q is None else without(tree.q[c], [tree.tokens[s] for s in kids[:j]])
        q_x = 1.0 if q_j is None else float(q_j[x])
        if q_x > 0.0 and rng.random() * q_x < (p[x] if r is None else r[x]):
            return c, x
        if q_j is None and r is None and j == len(kids) - 1:  # one one-hot rejection: p without x
            return None, p.sample(rng, exclude=x)
        base = p.dense() if r is None else r
        if q_j is None:
            nxt = base.copy()
            nxt[x] = 0.0
        else:
            nxt = np.maximum(base - q_j, 0.0)
        total = nxt.sum()
        if total > 0.0:  # else p == q_j up to rounding (or x held all of p): the rejection had probability ~0
            r = nxt / total
    return None, (p.sample(rng) if r is None else sample(r, rng))


def _check_rows(logits: npt.NDArray[np.floating], tree: DraftTree) -> None:
    if len(logits) != tree.n_nodes + 1:
        raise ValueError(f"tree verification of {tree.n_nodes} nodes needs {tree.n_nodes + 1} rows "
                         f"(got {len(logits)})")


def without(q_row: npt.NDArray[np.float64], removed: list[int]) -> npt.NDArray[np.float64]:
    """q_row with the `removed` tokens (earlier siblings) zeroed, renormalised; q_row itself when none are."""
    if not removed:
        return q_row
    out = q_row.copy()
    out[removed] = 0.0
    return out / out.sum()


def verify_tree(
    logits: npt.NDArray[np.floating],
    tree: DraftTree,
    params: SamplingParams,
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """Greedy or stochastic tree verification, by `params`."""
    if params.greedy:
        return verify_tree_greedy(logits, tree)
    return verify_tree_stochastic(logits, tree, params, rng)
