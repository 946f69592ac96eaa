"""Draft trees from a chain's own forward passes: the chain a drafter drew, plus, beside each of its
tokens, the alternatives its distribution there ranks next (leaves: no forward is spent on them).

The chain x̃₁..x̃_D comes first (node i at depth i+1, the first child of its parent), then the side
leaves: an alternative y at depth i+1 is worth reach(i)·d_i(y), reach(i) = d_0(x̃₁)···d_{i-1}(x̃ᵢ)
the chance the chain gets there by the drafter's own distributions d, and the best of them fill the
node budget (EAGLE-2's reranking by cumulative confidence, on a chain's frontier). Greedy, the
alternatives are the next most likely tokens (deterministic, q None). Sampled, a position's siblings
x̃ᵢ, y₁, y₂, … are draws without replacement from its q row (Gumbel top-k), and every sibling carries
that row, as tree.DraftTree's convention asks. How many alternatives a position gets is then fixed
before they are drawn, from the chain alone: a count that looked at the alternatives drawn would bias
the output (as a draft cut by q(x̃ᵢ) would); one that looks only at earlier draws keeps verification
lossless (tree.verify_tree).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from edgespec.tree import DraftTree


def top_ids(p: npt.NDArray[np.float64], k: int) -> list[int]:
    """The k likeliest ids of p with p > 0, likeliest first (ties: the lower id, as argmax)."""
    return [y for y in _largest(p, k) if p[y] > 0]


def gumbel_top(q: npt.NDArray[np.float64], k: int, rng: np.random.Generator) -> list[int]:
    """k draws without replacement from q (Gumbel top-k: the order is the order drawn), ids with q > 0 only."""
    with np.errstate(divide="ignore"):
        keys = np.log(q) + rng.gumbel(size=q.shape)
    return [y for y in _largest(keys, k) if np.isfinite(keys[y])]


def _largest(x: npt.NDArray[np.float64], k: int) -> list[int]:
    """The ids of the k largest values, largest first (ties: the lower id); O(V), no full sort of the
    vocabulary (a stable sort of 49k ids costs ~11 ms here, a partition ~0.2 ms)."""
    k = min(k, len(x))
    if k <= 0:
        return []
    ids = np.flatnonzero(x >= np.partition(x, len(x) - k)[len(x) - k])  # the k largest, and any tied with them
    return [int(y) for y in ids[np.lexsort((ids, -x[ids]))][:k]]


def sibling_counts(left: Sequence[float], room: int) -> list[int]:
    """How many alternatives each chain position gets when sampled, `room` in all: the k-th at position i
    is worth left[i] / k (left[i]: the mass the chain's token leaves there, times the chance the chain
    gets there), and the most valuable fill the room. Read from the chain alone."""
    slots = sorted(((left[i] / k, i) for i in range(len(left)) for k in range(1, room + 1)), key=lambda c: -c[0])
    count = [0] * len(left)
    for _, i in slots[:room]:
        count[i] += 1
    return count


def side_tree(tokens: Sequence[int], dists: Sequence[npt.NDArray[np.float64]], max_nodes: int,
              q: npt.NDArray[np.float64] | None, rng: np.random.Generator | None = None,
              confidence: Sequence[float] | None = None) -> DraftTree:
    """The chain `tokens` (dists[i]: the drafter's distribution its token i came from, (V,)) and up
    to max_nodes − len(tokens) side leaves (module docstring). q: the chain's sampled rows (D, V),
    or None when greedy; sampled, `rng` draws the alternatives. A side leaf's confidence is its
    probability at its position (conditional on its parent, as the chain's are)."""
    d = len(tokens)
    tokens, parents = list(tokens[:max_nodes]), list(range(-1, min(d, max_nodes) - 1))
    room = max_nodes - len(tokens)
    if room <= 0 or d == 0:
        return DraftTree(tokens, parents, None if q is None else q[:len(tokens)],
                         None if confidence is None else list(confidence[:len(tokens)]), side_leaves=True)
    reach = np.cumprod([1.0, *(float(dists[i][tokens[i]]) for i in range(d - 1))])
    if q is None:  # greedy: the alternatives themselves are ranked (deterministic: nothing to bias)
        cands = [(reach[i] * float(dists[i][y]), i, y) for i in range(d)
                 for y in top_ids(np.asarray(dists[i]), room + 1) if y != tokens[i]]
        picked = sorted(cands, key=lambda c: -c[0])[:room]
        alts = {i: [y for _, j, y in sorted(picked, key=lambda c: -c[0]) if j == i] for i in range(d)}
    else:  # sampled: how many a position gets is fixed before they are drawn (by the mass its
        # chain token leaves, reach(i)·(1 − q_i(x̃ᵢ)), the k-th alternative counted at 1/k of it),
        # then they are drawn without replacement after its chain token (Gumbel top-k)
        assert rng is not None
        count = sibling_counts([reach[i] * (1.0 - float(q[i][tokens[i]])) for i in range(d)], room)
        alts = {}
        for i in range(d):
            rest = q[i].copy()
            rest[tokens[i]] = 0.0  # after the chain's token: not it again, q > 0 only
            alts[i] = gumbel_top(rest, count[i], rng)
    rows = None if q is None else [q[i] for i in range(d)]
    conf = None if confidence is None else list(confidence[:d])
    for i in range(d):
        for y in alts[i]:
            tokens.append(y)
            parents.append(i - 1)
            if rows is not None:
                rows.append(q[i])
            if conf is not None:
                conf.append(float(dists[i][y]))
    return DraftTree(tokens, parents, None if rows is None else np.stack(rows), conf, side_leaves=True)
