"""Draft trees under `-k auto` (`--tree auto`): each cycle verifies the Scheduler's chain, or a tree
of up to `max_nodes` nodes when the tree is expected to give more tokens per ms.

A drafter that drafts trees (drafters.base.TreeDrafter) is asked for a tree where the Scheduler
would ask for a chain (`TreeScheduling`, a Scheduling in the engine's loop): its chain of first
children is the chain the drafter drafts (the tree's `chain`, with its costs), and the Scheduler
plans, cuts and learns that chain as always. The tree is then priced. Node i is accepted with

    v_i = S_d                    for the chain's node at depth d (the Scheduler's survival),
    v_i = v_parent · c(conf_i)   for every other node,

c being a calibration (schedule.acceptance.Calibration) of the drafter's conditional probability of
a node at its parent into the chance the node is accepted once its parent is, learned from the
nodes verified beside the chain (a bin not seen yet: the confidence itself, or for a drafter whose
confidences are shares of its continuations (n-gram) that share times the chain's first-position rate). Greedy, at most one child of a node is accepted, so a subtree
is expected to emit 1 + Σ v over its nodes; the best subtree of m nodes is the m largest v (a node
never outvalues its parent; ties keep the earlier node), and

    rate(m) = (1 + Σ_{m largest} v) / (T_draft + T_verify(m + 1)),

T_draft being what the drafting cost (sunk). The tree is verified instead of the chain when its best
rate beats the chain's planned rate by TREE_MARGIN and it holds more than the chain's nodes. A probe
(the Scheduler trying a drafter it does not expect to win) stays a chain: it is there to measure the
chain's acceptance, and a tree's dearer verification would spend the probing budget faster.

Greedy decoding and deterministic drafts (q None) may be cut after they are made, as above. A
sampled draft's own tokens must not decide what is verified (the choice would bias the output:
drafters.tree_draft), so a sampled tree is priced only when it is a side tree (`DraftTree.side_leaves`:
the draft model's and the block heads' trees: the chain drawn whole first, then beside each chain
token its siblings, leaves, drawn without replacement from the same row), and cut by a rule that
reads only the chain: how many siblings each position got (fixed by the chain when they were drawn)
and the chain's survival. The j-th sibling at depth d is worth

    v = S_{d−1} · (1 − a_d) · (1 − h_1) ··· (1 − h_{j−1}) · h_j,

a_d = S_d / S_{d−1} the chain token's own chance there and h_j (schedule.acceptance.SiblingRates)
the chance the j-th sibling is accepted once the chain token and the siblings before it were
rejected (recursive rejection sampling tries them in draw order), learned from the sampled side trees
verified, starting from a_d. The siblings are added a position's next one at a time, the most
valuable first, so every position keeps a prefix of what was drawn there, and the tree is verified
as above when one of its sizes beats the chain by TREE_MARGIN. Which siblings are kept never depends
on the siblings' own tokens, so recursive rejection sampling over the kept ones stays lossless
(tree.verify_tree_stochastic). Drafters whose sampled trees are not side trees (EAGLE-3's dynamic
tree, Medusa's candidates) draft chains when sampled (drafters.base.prices_sampled_trees): their
trees would be drafted only to be dropped.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from edgespec.drafters.base import Draft, Drafter, prices_sampled_trees
from edgespec.sampling import Dist, SamplingParams
from edgespec.schedule.acceptance import Calibration, SiblingRates
from edgespec.schedule.rate import Decision
from edgespec.schedule.scheduler import Scheduler
from edgespec.tree import DraftTree

TREE_MARGIN = 0.03  # a tree must promise this much more than the chain's rate (its rows cost more to read)


def node_values(tree: DraftTree, chain: Sequence[int], survival: Sequence[float], calibration: Calibration,
                deepest: int, scale: float = 1.0) -> np.ndarray:
    """v per node (the module docstring), 0 below depth `deepest`; a node with no confidence is
    calibrated as a confidence of 0.5. A bin the calibration has not seen starts from conf × `scale`
    (a drafter whose confidences are shares of its continuations, not chances of being right, as
    n-gram trees': the chain's first-position rate)."""
    v, on_chain, conf = np.zeros(tree.n_nodes), {node: d for d, node in enumerate(chain)}, tree.confidence
    for i, par in enumerate(tree.parents):
        if tree.depth[i] > deepest:
            continue
        if i in on_chain:
            v[i] = survival[on_chain[i]] if on_chain[i] < len(survival) else 0.0
        else:
            c = _clip(conf[i] if conf is not None else 0.5)
            v[i] = (1.0 if par < 0 else v[par]) * calibration(c, c * scale)
    return v


def best_subtree(values: np.ndarray, draft_ms: float, t_verify: Sequence[float]) -> tuple[list[int], float, float]:
    """The nodes of the subtree with the highest rate (the m largest values), its expected tokens and ms;
    t_verify[k] is T(k), so at most len(t_verify) − 2 nodes."""
    order = sorted(range(len(values)), key=lambda i: (-values[i], i))[: len(t_verify) - 2]
    best, tokens, best_tokens, best_ms = 0, 1.0, 1.0, draft_ms + t_verify[1]
    for m, i in enumerate(order, 1):
        tokens += values[i]
        if tokens / (draft_ms + t_verify[m + 1]) > best_tokens / best_ms:
            best, best_tokens, best_ms = m, tokens, draft_ms + t_verify[m + 1]
    return sorted(order[:best]), best_tokens, best_ms


def observe_nodes(calibration: Calibration, tree: DraftTree, chain: Sequence[int], path: Sequence[int]) -> None:
    """Calibrate on the verified nodes beside the chain whose parent was accepted (or is the root)."""
    if tree.confidence is None:
        return
    reached, first, accepted = {-1, *path}, set(chain), set(path)
    for i, par in enumerate(tree.parents):
        if par in reached and i not in first:
            calibration.observe_one(_clip(tree.confidence[i]), i in accepted)


def siblings_beside(tree: DraftTree, chain: Sequence[int]) -> list[list[int]]:
    """Per chain position d (0-based), the other children of its parent: the siblings drawn beside
    chain node d, in the order they were drawn (index order)."""
    return [[c for c in tree.children(chain[d - 1] if d else -1) if c != chain[d]] for d in range(len(chain))]


def best_sides(counts: Sequence[int], survival: Sequence[float], rates: SiblingRates, draft_ms: float,
               t_verify: Sequence[float]) -> tuple[list[tuple[int, int]], float, float]:
    """A sampled side tree's best size (module docstring): its siblings as (position, rank), a prefix
    of the counts[d] drawn at each position, its expected tokens and ms. Reads the chain's survival
    and the counts only, never the siblings drawn."""
    n, values = len(counts), []
    for d in range(n):
        reach = survival[d - 1] if d else 1.0
        a = survival[d] / reach if reach > 0 else 0.0
        miss, row = reach * (1.0 - a), []
        for j in range(1, counts[d] + 1):
            h = rates(j, a)
            row.append(miss * h)
            miss *= 1.0 - h
        values.append(row)
    order, nxt = [], [0] * n
    while len(order) < len(t_verify) - 2 - n:
        d = max(range(n), key=lambda i: values[i][nxt[i]] if nxt[i] < counts[i] else -1.0, default=None)
        if d is None or nxt[d] >= counts[d]:
            break
        order.append((d, nxt[d] + 1, values[d][nxt[d]]))
        nxt[d] += 1
    tokens = best_tokens = 1.0 + sum(survival[:n])
    best, best_ms = 0, draft_ms + t_verify[n + 1]
    for m, (_, _, v) in enumerate(order, 1):
        tokens += v
        if tokens / (draft_ms + t_verify[n + m + 1]) > best_tokens / best_ms:
            best, best_tokens, best_ms = m, tokens, draft_ms + t_verify[n + m + 1]
    return [(d, j) for d, j, _ in order[:best]], best_tokens, best_ms


def observe_siblings(rates: SiblingRates, tree: DraftTree, chain: Sequence[int], path: Sequence[int]) -> None:
    """Learn h_j from a verified sampled side tree: at the position where the walk left the chain, the
    siblings tried in order, up to the one accepted (if any)."""
    for d, sibs in enumerate(siblings_beside(tree, chain)):
        took = path[d] if len(path) > d else None
        if took == chain[d]:
            continue
        for j, s in enumerate(sibs, 1):
            rates.observe(j, s == took)
            if s == took:
                break
        return


def _clip(c: float) -> float:
    return min(1.0, max(0.0, float(c)))


class TreeDrafting:
    """The Scheduler's drafter: drafts a tree, hands the Scheduler the tree's chain (`from_tree`)."""

    def __init__(self, drafter: Drafter, max_nodes: int) -> None:
        self.drafter, self.max_nodes = drafter, max_nodes
        self.tree: DraftTree | None = None
        self.chain = Draft([])

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop=None) -> Draft:
        self.tree = self.drafter.draft_tree(context, self.max_nodes, gamma, params, rng,  # type: ignore[attr-defined]
                                            stop=stop)
        self.chain = self.from_tree(self.tree)
        return self.chain

    @staticmethod
    def from_tree(tree: DraftTree) -> Draft:
        """The tree's chain of first children as a Draft: the drafter's own chain (`tree.chain_draft`: its
        confidences or none, its cost fields) when it drew one, else the tree's nodes."""
        chain = tree.first_chain()
        d = tree.chain_draft if isinstance(tree.chain_draft, Draft) else None
        conf = d.confidence if d is not None else (
            None if tree.confidence is None or not chain else [tree.confidence[i] for i in chain])
        return Draft([tree.tokens[i] for i in chain], None if tree.q is None else tree.q[chain],
                     None if conf is None else list(conf[:len(chain)]), synced=d.synced if d else 0,
                     copied=d.copied if d else 0, support=d.support if d else None)


class TreeScheduling:
    """A Scheduler's cycles with trees (module docstring): the engine's Scheduling, plus `observe_tree`
    for a cycle that verified the tree its Decision carries (`Decision.tree`)."""

    def __init__(self, sched: Scheduler, max_nodes: int) -> None:
        self.sched, self.max_nodes = sched, max_nodes
        self._chain = Draft([])  # the latest tree's chain, as drafted
        self._sampled = False  # the latest tree was sampled (q rows): its siblings teach SiblingRates

    def new_generation(self, n_prompt: int, max_tokens: int | None = None) -> None:
        self.sched.new_generation(n_prompt, max_tokens)

    def draft(self, drafter: Drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator, baseline_ms: float | None = None) -> tuple[Draft, Decision]:
        sched, drafting = self.sched, TreeDrafting(drafter, self.max_nodes)
        if not params.greedy and not prices_sampled_trees(drafter):  # its sampled trees are never cut: a chain
            self._chain, self._sampled = Draft([]), False
            return sched.draft(drafter, context, limit, params, rng, baseline_ms)
        d, dec = sched.draft(drafting, context, limit, params, rng, baseline_ms)
        tree, self._chain = drafting.tree, drafting.chain
        self._sampled = tree is not None and tree.q is not None and not params.greedy
        if tree is None or not tree.n_nodes or dec.probe or (self._sampled and not tree.side_leaves):
            return d, dec
        t0 = time.perf_counter()
        chain, conf = tree.first_chain(), self._chain.confidence
        survival = sched.survival(conf, len(chain) if conf is not None else 0)
        t_verify = sched.cost.t_verify(len(context) - 1)
        if self._sampled:  # the chain as drafted (a sampled chain is not cut), a prefix of siblings beside it
            sibs = siblings_beside(tree, chain)
            sides, tokens, ms = best_sides([len(s) for s in sibs], survival[:len(chain)], sched.tree_siblings,
                                           dec.draft_ms, t_verify)
            keep = [*chain, *(sibs[p][j - 1] for p, j in sides)]
        else:
            values = node_values(tree, chain, survival, sched.tree_calibration, sched.longest(limit),
                                 1.0 if conf is not None else sched.survival(None, 0)[0])
            keep, tokens, ms = best_subtree(values, dec.draft_ms, t_verify)
        rate = dec.tokens / dec.ms if dec.ms > 0 else 0.0
        if len(keep) > len(d.tokens) and set(keep) - set(chain) and tokens / ms > rate * (1.0 + TREE_MARGIN):
            sub = tree.subtree(keep)
            dec = replace(dec, gamma=sub.n_nodes, tokens=tokens, ms=ms, tree=sub,
                          seconds=dec.seconds + time.perf_counter() - t0)
        return d, dec

    def observe(self, draft: Draft, accepted: int, t_draft: float, t_verify: float,
                context: int | None = None, rollback: float = 0.0) -> None:
        self.sched.observe(draft, accepted, t_draft, t_verify, context, rollback)

    def observe_tree(self, tree: DraftTree, path: Sequence[int], t_draft: float, t_verify: float,
                     context: int | None = None) -> None:
        """A verified tree (`Decision.tree`): its chain is learned as a chain of its length, its
        other nodes calibrate the pricing, its verification times T(nodes + 1)."""
        chain = tree.first_chain()
        on_chain = 0
        while on_chain < len(path) and on_chain < len(chain) and path[on_chain] == chain[on_chain]:
            on_chain += 1
        if self._sampled:
            observe_siblings(self.sched.tree_siblings, tree, chain, path)
        else:
            observe_nodes(self.sched.tree_calibration, tree, chain, path)
        d = self._chain  # the verified chain is a prefix of it
        self.sched.observe(Draft(d.tokens[:len(chain)], None, None if d.confidence is None else d.confidence[:len(chain)],
                                 synced=d.synced, copied=d.copied), on_chain, t_draft, t_verify, context,
                           verified=tree.n_nodes + 1)

    def emitted(self, tokens: Sequence[int], probs: Sequence[Dist] | None = None) -> None:
        self.sched.emitted(tokens, probs)
