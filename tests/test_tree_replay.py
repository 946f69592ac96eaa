"""Tree traces replayed (edgespec.bench.tree_replay): the accepted path of a recorded tree is exact, a
fixed tree policy pays its nodes' verification, and `--tree auto` (schedule.trees over the recorded
trees, the real Scheduler on modeled time) takes trees where alternatives hold the target's tokens
and verification is flat, and stays with chains where verification is steep."""

from __future__ import annotations

import numpy as np

from edgespec.bench.devices import Device
from edgespec.bench.simulate import Costs, prepare, tree_path
from edgespec.bench.trace import Trace, TraceSet
from edgespec.bench.tree_replay import cells, replay_trees, run_tree_fixed
from edgespec.tree import DraftTree


def _trace(n: int = 120, seed: int = 0) -> Trace:
    """A text of n tokens where, at every position, the drafter's chain guesses the next two tokens
    right with probability 0.5 each and its second choice holds the right token whenever the first misses."""
    rng = np.random.default_rng(seed)
    out = [int(t) for t in rng.integers(10, 1000, size=n)]
    drafts, trees = [], []
    for p in range(n):
        tokens, parents, conf, chain = [], [], [], []
        node = -1
        for d in range(3):
            if p + d >= n:
                break
            right = rng.random() < 0.5
            first = out[p + d] if right else 5
            tokens += [first, out[p + d] if not right else 6]  # first choice, then its sibling
            parents += [node, node]
            conf += [0.5, 0.4]
            chain.append(first)
            node = len(tokens) - 2  # the chain goes on below the first choice
        drafts.append(chain)
        trees.append([tokens, parents, conf])
    return Trace("t-01", "cat", 10, out, False, n, drafts, [[0.5] * len(d) for d in drafts], None, None, None, trees)


def _set() -> TraceSet:
    return TraceSet("target.gguf", "head.gguf", "head", 0.0, 3, {1: 10.0}, 0.0, 0.0, "cpu", "abc", "2026-12-06",
                    [_trace()])


def _device(name: str, t: list[float], kind: str = "head") -> Device:
    return Device(name, "test", tuple([0.0, *t]), {kind: (0.0, 0.01)})


FLAT = _device("flat", [10.0 + 0.05 * k for k in range(32)])
STEEP = _device("steep", [10.0 * (k + 1) for k in range(32)])


def test_tree_path_follows_the_output():
    t = DraftTree([5, 7, 6, 8], [-1, -1, 1, 1])  # root → 5 | 7 → (6 | 8)
    assert tree_path(t, [7, 8, 9], 0) == [1, 3]
    assert tree_path(t, [9, 8], 0) == []
    assert tree_path(t, [0, 7, 6, 1], 1) == [1, 2]


def test_a_fixed_tree_accepts_what_its_alternatives_hold():
    task, c = prepare(_trace(), 0.0), Costs(FLAT, "head")
    chain_only = run_tree_fixed(task, c, 3, 1)  # one node: the chain's first token, right half the time
    tree = run_tree_fixed(task, c, 3, 6)  # both choices at every depth; the walk goes deeper below a right first
    assert abs(chain_only.tokens / chain_only.cycles - 1.5) < 0.15  # 1 + 0.5
    assert abs(tree.tokens / tree.cycles - 2.75) < 0.2  # 1 + (1 + 0.5 · (1 + 0.5)): depth 1 always passes


def test_tree_auto_takes_trees_where_they_pay():
    flat = cells({"flat": {"s": replay_trees(_set(), FLAT)}})[0][3]
    assert flat["tree-auto"] > 1.2 * flat["chain"], flat
    assert flat["tree-auto"] >= 0.98 * max(flat["chain"], flat["best-tree"]), flat
    steep = cells({"steep": {"s": replay_trees(_set(), STEEP)}})[0][3]
    assert steep["tree-auto"] >= 0.98 * max(steep["chain"], steep["best-tree"]), steep


def _sampled_set(n: int = 200) -> TraceSet:
    """T 0.7: every position's chain token passes half the time, and when it does not, the siblings
    recorded beside it pass with chances 0.6 then 0.5 (tree_accept); the chain's token had q 0.4."""
    rng = np.random.default_rng(1)
    out = [int(t) for t in rng.integers(10, 1000, size=n)]
    drafts = [[7, 8, 9][: n - p] for p in range(n)]
    trees = [[[*d, 5, 6], [*range(-1, len(d) - 1), -1, -1], [0.4] * (len(d) + 2)] for d in drafts]
    trace = Trace("t-01", "cat", 10, out, False, n, drafts, [[0.5] * len(d) for d in drafts], None, [0.5] * n,
                  None, trees, [[0.5, 0.6, 0.5]] * n)
    return TraceSet("target.gguf", "draft.gguf", "model", 0.7, 3, {1: 10.0}, 0.0, 0.0, "cpu", "abc", "2026-12-07",
                    [trace])


def test_sampled_side_trees_replay_their_recorded_chances():
    ts = _sampled_set()
    task, c = prepare(ts.traces[0], 0.7), Costs(_device("flat", [10.0 + 0.05 * k for k in range(32)], "model"), "model")
    chain_only = run_tree_fixed(task, c, 3, 3)
    tree = run_tree_fixed(task, c, 3, 9)
    assert abs(chain_only.tokens / chain_only.cycles - 1.875) < 0.2  # 1 + 0.5 + 0.25 + 0.125
    # a miss at depth i is saved by a sibling with chance 0.6 + 0.4 · 0.5 = 0.8 where it has two
    assert tree.tokens / tree.cycles > 1.25 * chain_only.tokens / chain_only.cycles
    flat = cells({"flat": {"s": replay_trees(ts, _device("flat", [10.0 + 0.05 * k for k in range(32)], "model"))}})[0][3]
    assert flat["tree-auto"] > 1.1 * flat["chain"] and flat["tree-auto"] >= 0.98 * flat["best-tree"], flat
    steep = cells({"steep": {"s": replay_trees(ts, _device("steep", [10.0 * (k + 1) for k in range(32)], "model"))}})[0][3]
    assert steep["tree-auto"] >= 0.98 * max(steep["chain"], steep["best-tree"]), steep
