"""One speculative cycle over a draft tree: the drafter proposes a tree (drafters.base.TreeDrafter),
the target scores the pending token and every node in one forward with tree attention
(backends.trees), acceptance walks the tree (tree.verify_tree: greedy, or recursive rejection sampling
over siblings), and the target keeps the accepted path. A chain is the tree of width 1; the engine
runs this cycle instead of its chain cycle when it was built with `tree=N` (trees of up to N nodes
every cycle, forced: the scheduler does not price trees yet).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from edgespec.backends.trees import tree_ops
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams
from edgespec.stats import Stats
from edgespec.tree import DraftTree, verify_tree

MAX_TREE = 64  # most nodes a forced tree may have (one forward; a llama.cpp sequence per leaf)


def check_tree(tree: int | str | None, num_draft: int | str | None = None) -> int:
    """The engine's tree option as a node count: 0 = off (chains only), N = trees of up to N nodes;
    trees need a fixed γ (`num_draft`, when given), their depth."""
    if tree in (None, "off", 0, "0"):
        return 0
    try:
        n = int(tree)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        n = -1
    if not 1 <= n <= MAX_TREE:
        raise EdgespecError(f"tree must be 'off' or a node count in [1, {MAX_TREE}] (got {tree!r})")
    if num_draft == "auto":
        raise EdgespecError("draft trees (tree=N, --tree) need a fixed num_draft γ (-k), their depth: "
                            "auto prices chains only")
    return n


def within_depth(tree: DraftTree, depth: int) -> DraftTree:
    """`tree` without the nodes deeper than `depth` (the tokens the cycle may still emit, less one):
    their descendants go with them, the rest keep their order."""
    keep = [i for i in range(tree.n_nodes) if tree.depth[i] <= depth]
    if len(keep) == tree.n_nodes:
        return tree
    new = {old: k for k, old in enumerate(keep)}
    return DraftTree([tree.tokens[i] for i in keep], [new.get(tree.parents[i], -1) for i in keep],
                     None if tree.q is None else tree.q[keep],
                     None if tree.confidence is None else [tree.confidence[i] for i in keep])


def tree_cycle(engine: Any, pending: int, limit: int, params: SamplingParams, rng: np.random.Generator,
               stats: Stats) -> tuple[list[int], int]:
    """One cycle of `engine` (an Engine: this module sits below it) over a tree of at most engine.tree
    nodes and depth `limit`: (emitted tokens, drafts accepted), as Engine._cycle returns them."""
    target, kv = engine.target, engine._kv
    if engine._tree_ops is None:
        engine._tree_ops = tree_ops(target)
    ops = engine._tree_ops
    t0 = time.perf_counter()
    kv.append(pending)
    try:
        tree = engine.drafter.draft_tree(kv, min(engine.tree, target.n_ctx - len(kv)), limit, params, rng)
    finally:
        kv.pop()
    tree = within_depth(tree, limit)
    t1 = time.perf_counter()
    try:
        logits = ops.eval_tree(pending, tree.tokens, tree.parents)  # (n+1, V): the root's row, then each node's
        t2 = time.perf_counter()
        path, token = verify_tree(logits, tree, params, rng)
        ops.keep_path(path)
    except BaseException:
        ops.drop_tree()
        raise
    accepted = [tree.tokens[i] for i in path]
    kv.append(pending)
    kv.extend(accepted)
    t3 = time.perf_counter()
    stats.record_cycle(tree.n_nodes, len(path), t3 - t0, None, (t1 - t0, t2 - t1, 0.0, t3 - t2))
    stats.tree_cycles += 1
    return [*accepted, token], len(path)
