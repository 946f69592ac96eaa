"""Shared by the tree-attention tests of each backend (test_tree_llama.py, test_tree_mlx.py)."""

from __future__ import annotations

import numpy as np


def random_tree(rng: np.random.Generator, n_vocab: int, max_nodes: int = 12, width: int = 3,
                depth: int = 3) -> tuple[list[int], list[int]]:
    """(tokens, parents) of a random tree in topological order, siblings with distinct tokens."""
    n = int(rng.integers(1, max_nodes + 1))
    tokens: list[int] = []
    parents: list[int] = []
    depths = {-1: 0}
    kids: dict[int, list[int]] = {-1: []}
    while len(tokens) < n:
        open_ = [k for k in kids if len(kids[k]) < width and depths[k] < depth]
        if not open_:
            break
        par = open_[int(rng.integers(len(open_)))]
        tok = int(rng.integers(n_vocab))
        if tok in [tokens[c] for c in kids[par]]:
            continue
        i = len(tokens)
        tokens.append(tok)
        parents.append(par)
        depths[i], kids[i] = depths[par] + 1, []
        kids[par].append(i)
    return tokens, parents


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| over the row's logit range, the worst row."""
    span = want.max(axis=-1) - want.min(axis=-1)
    return float((np.abs(got - want).max(axis=-1) / span).max())
