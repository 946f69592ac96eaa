"""One speculative cycle over a draft tree: the drafter proposes a tree (drafters.base.TreeDrafter),
the target scores the pending token and every node in one forward with tree attention
(backends.trees), acceptance walks the tree (tree.verify_tree: greedy, or recursive rejection sampling
over siblings), and the target keeps the accepted path. A chain is the tree of width 1.

The engine runs `tree_cycle` instead of its chain cycle when built with `tree=N` and a fixed γ (trees
of up to N nodes and depth γ every cycle, forced), and `verify_tree_cycle` for a tree its scheduler
chose (`tree="auto"` under num_draft "auto": schedule.trees prices a tree against the chain each cycle).
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


def check_tree(tree: int | str | None, num_draft: int | str | None = None) -> int | str:
    """The engine's tree option: 0 = off (chains only), "auto" = priced against the chain every cycle
    under num_draft "auto" (with a fixed γ: chains), N = trees of up to N nodes every cycle, which
    need a fixed γ (`num_draft`, when given), their depth."""
    if tree in (None, "off", 0, "0"):
        return 0
    if isinstance(tree, str) and tree.strip().lower() == "auto":
        return "auto"
    try:
        n = int(tree)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        n = -1
    if not 1 <= n <= MAX_TREE:
        raise EdgespecError(f"tree must be 'off', 'auto' or a node count in [1, {MAX_TREE}] (got {tree!r})")
    if num_draft == "auto":
        raise EdgespecError("forced draft trees (tree=N, --tree N) need a fixed num_draft γ (-k), their depth "
                            "(under -k auto, tree='auto' prices trees every cycle)")
    return n


def within_depth(tree: DraftTree, depth: int) -> DraftTree:
    """`tree` without the nodes deeper than `depth` (the tokens the cycle may still emit, less one):
    their descendants go with them, the rest keep their order."""
    return tree.subtree([i for i in range(tree.n_nodes) if tree.depth[i] <= depth])


def tree_scheduling(engine: Any, sched: Any) -> Any:
    """The engine's scheduler for this generation, with trees priced when `engine.tree` is "auto",
    its drafter drafts trees and its target verifies them (schedule.trees.TreeScheduling)."""
    from edgespec.drafters.base import can_draft_trees
    from edgespec.schedule.scheduler import K_MAX, Scheduler
    from edgespec.schedule.trees import TreeScheduling

    if engine.tree != "auto" or not isinstance(sched, Scheduler) or not can_draft_trees(engine.drafter):
        return sched
    leaves = getattr(engine.target, "tree_leaves", None)  # llama.cpp: sequences for as many leaves
    if engine._tree_ops is None and leaves != 0:
        try:
            engine._tree_ops = tree_ops(engine.target)
        except EdgespecError:  # a recurrent target, a runtime without tree attention: chains
            leaves = 0
    if leaves == 0:
        engine.tree = 0
        return sched
    return TreeScheduling(sched, min(K_MAX - 1, leaves or K_MAX - 1))


def tree_cycle(engine: Any, pending: int, limit: int, params: SamplingParams, rng: np.random.Generator,
               stats: Stats) -> tuple[list[int], int]:
    """One cycle of `engine` (an Engine: this module sits below it) over a tree of at most engine.tree
    nodes and depth `limit`: (emitted tokens, drafts accepted), as Engine._cycle returns them."""
    kv = engine._kv
    t0 = time.perf_counter()
    kv.append(pending)
    try:
        tree = engine.drafter.draft_tree(kv, min(engine.tree, engine.target.n_ctx - len(kv)), limit, params, rng)
    finally:
        kv.pop()
    return verify_tree_cycle(engine, pending, within_depth(tree, limit), params, rng, stats, t0)


def verify_tree_cycle(engine: Any, pending: int, tree: DraftTree, params: SamplingParams,
                      rng: np.random.Generator, stats: Stats, t0: float, sched: Any = None,
                      plan: Any = None) -> tuple[list[int], int]:
    """Verify `tree` after `pending` (drafted since t0) and keep its accepted path; `sched` (with
    `plan`, its Decision) learns from the cycle (schedule.trees.TreeScheduling.observe_tree)."""
    target, kv = engine.target, engine._kv
    if engine._tree_ops is None:
        engine._tree_ops = tree_ops(target)
    ops, n_cached = engine._tree_ops, len(kv)
    if tree.n_nodes > (room := target.n_ctx - n_cached - 1):  # the nodes that fit (topological: parents first)
        tree = tree.subtree(range(max(0, room)))
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
    if sched is not None:
        sched.observe_tree(tree, path, t1 - t0 - (plan.seconds if plan else 0.0), t3 - t1, n_cached)
        sched.emitted([*accepted, token], None)
    stats.record_cycle(tree.n_nodes, len(path), t3 - t0, plan, (t1 - t0, t2 - t1, 0.0, t3 - t2))
    stats.tree_cycles += 1
    return [*accepted, token], len(path)
