"""Draft trees from feature heads (issue #50): EAGLE-2's dynamic tree for EAGLE-3 heads (`dynamic_tree`),
and a block's per-position alternatives for DFlash and DSpark heads (`block_tree`).

Both give `DraftTree.confidence[i]` as the drafter's CONDITIONAL probability of node i's token given its
parent: the probability, in the distribution node i was drawn or ranked from (its parent's), of its
token (greedy: the head's raw softmax, T = 1; sampled: the processed q row it was drawn from). A caller
multiplies them along a path for a cumulative value.

Losslessness when sampling (tree.verify_tree's recursive rejection sampling): a node's children are
draws WITHOUT replacement from one q row (Gumbel top-k), every child carrying that row, and how many
children a node gets is decided before they are drawn, from what was drawn before them (the node, its
ancestors and the nodes of its own and earlier depths), never from the children's own values: a count
that looked at them would bias the output, as a draft cut by q(x̃) would. No node is pruned after it
was drawn. Greedy drafts are deterministic (q None), so anything may rank them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from edgespec.drafters.tree_draft import gumbel_top, side_tree, top_ids
from edgespec.sampling import SamplingParams, process_rows
from edgespec.tree import DraftTree, node_path

F64 = npt.NDArray[np.float64]
RANK = SamplingParams(temperature=1.0)  # greedy trees rank alternatives by the head's raw softmax
TOP_K = 4  # EAGLE-2's k: nodes expanded per depth, children per expanded node


def rank_dist(logits: npt.NDArray[np.floating]) -> F64:
    """The raw softmax (V,) of one row of logits (−inf: probability 0), what greedy trees rank by."""
    return process_rows(np.asarray(logits)[None], RANK)[0].dense()


def conditional(tree: DraftTree, dists: Sequence[F64]) -> DraftTree:
    """`tree` (a chain and its side leaves: the node at depth d was drawn or ranked from dists[d−1])
    with each node's conditional probability as its confidence."""
    conf = [float(dists[d - 1][t]) for t, d in zip(tree.tokens, tree.depth)]
    return DraftTree(tree.tokens, tree.parents, tree.q, conf, side_leaves=tree.side_leaves)


def block_tree(tokens: Sequence[int], dists: Sequence[F64], max_nodes: int, q: F64 | None,
               rng: np.random.Generator) -> DraftTree:
    """A block drafter's tree (DDTree-style): the block's chain `tokens` and, beside each position, the
    next most likely tokens of that position's distribution dists[i] as side leaves, the best of them by
    reach × probability filling `max_nodes` (drafters.tree_draft.side_tree); confidences conditional.
    q: the chain's sampled rows (None: greedy)."""
    if not tokens or max_nodes <= 0:
        return DraftTree([], [])
    return conditional(side_tree(list(tokens), list(dists), max_nodes, q, rng), dists)


def dynamic_tree(root: F64, expand: Callable[[list[list[int]], list[list[int]]], list[F64]], *, max_nodes: int,
                 max_depth: int, sampled: bool, rng: np.random.Generator, top_k: int = TOP_K) -> DraftTree:
    """EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858) over a drafter that can score any
    node's children: `root` is the distribution (V,) of the root's children, `expand(paths, tokens)` those
    of the children of the nodes at the end of `paths` (each a list of node indices from the root's child
    down; `tokens` theirs), the nodes a depth expands, in path order (a subtree's together, so a head
    that replays paths replays a shared prefix once; one that branches runs them in one step: their
    ancestors were all expanded before). Distributions are the raw softmax when
    greedy, the processed q rows when `sampled`. A node's value is its cumulative confidence, the product
    of the conditional probabilities along its path.

    Greedy (EAGLE-2 as published): depth 1 holds the root's top_k tokens; at each further depth the
    top_k nodes of the last depth by value are expanded, each into its top_k tokens; then all drafted
    nodes are reranked by value to `max_nodes` (a child's value never exceeds its parent's and ties go
    to the earlier index, so the kept nodes are a subtree, kept in index order: topological, siblings
    likeliest first). A node whose children could not make the cut (max_nodes nodes already worth at
    least as much) is not expanded.

    Sampled: the same expansion, but nothing is pruned after it was drawn; instead each depth gets a
    share of the node budget (what is left ÷ the depths left, rounded up), split before the depth is
    drawn among the expanded nodes' child slots by value(node) × the j-th largest probability of its
    row (known before any draw: a slot's worth never looks at the token that will fill it), and each
    expanded node's children are then drawn without replacement from its row (Gumbel top-k), each
    carrying that row. Which nodes are expanded and how many children each gets depend only on nodes
    drawn before those children, as lossless verification needs (module docstring).
    """
    tokens: list[int] = []
    parents: list[int] = []
    value: list[float] = []  # cumulative confidence
    cond: list[float] = []  # conditional probability (DraftTree.confidence)
    rows: list[F64] = []  # the row each node was drawn / ranked from (its parent's)
    depth_of: list[int] = []
    if max_nodes <= 0 or max_depth <= 0:
        return DraftTree([], [])

    def add(parent: int, dist: F64, kids: list[int]) -> None:
        base = 1.0 if parent < 0 else value[parent]
        for y in kids:
            tokens.append(y)
            parents.append(parent)
            value.append(base * float(dist[y]))
            cond.append(float(dist[y]))
            rows.append(dist)
            depth_of.append(1 if parent < 0 else depth_of[parent] + 1)

    def share(depth: int) -> int:  # sampled: the node budget of `depth`
        return math.ceil((max_nodes - len(tokens)) / (max_depth - depth + 1))

    if sampled:
        add(-1, root, gumbel_top(root, min(top_k, share(1)), rng))
    else:
        add(-1, root, top_ids(root, top_k))
    layer = list(range(len(tokens)))
    for depth in range(2, max_depth + 1):
        chosen = sorted(layer, key=lambda i: (-value[i], i))[:top_k]
        if not sampled:  # children of a node worth less than max_nodes others cannot make the cut
            chosen = [i for i in chosen if sum(1 for j, v in enumerate(value) if j != i and v >= value[i]) < max_nodes]
        if not chosen or (sampled and len(tokens) >= max_nodes):
            break
        chosen.sort(key=lambda i: node_path(parents, i))  # subtrees together
        paths = [node_path(parents, i) for i in chosen]
        dists = dict(zip(chosen, expand(paths, [[tokens[j] for j in p] for p in paths]), strict=True))
        start = len(tokens)
        if sampled:
            slots = sorted(((value[i] * float(p), n, i) for i in chosen
                            for n, p in enumerate(dists[i][top_ids(dists[i], top_k)])),
                           key=lambda s: (-s[0], s[1], s[2]))[: share(depth)]
            for i in chosen:
                count = sum(1 for _, _, j in slots if j == i)
                if count:
                    add(i, dists[i], gumbel_top(dists[i], count, rng))
        else:
            for i in chosen:
                add(i, dists[i], top_ids(dists[i], top_k))
        layer = list(range(start, len(tokens)))
        if not layer:
            break
    keep = list(range(len(tokens)))
    if not sampled and len(tokens) > max_nodes:
        keep = sorted(sorted(keep, key=lambda i: (-value[i], i))[:max_nodes])
    new = {old: k for k, old in enumerate(keep)}
    return DraftTree([tokens[i] for i in keep], [new[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                     np.stack([rows[i] for i in keep]) if sampled and keep else None, [cond[i] for i in keep])
