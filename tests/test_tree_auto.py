"""Trees priced every cycle (`tree="auto"`, edgespec.schedule.trees): the pricing's parts, and the engine
with a tree scheduler: greedy output == plain output, token for token, whichever of tree and chain each
cycle verifies; trees are chosen where the verification cost is flat and chains where it is steep; sampled,
side trees cut by the chain alone keep the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest
from test_lossless_reference import PROMPTS

from edgespec.backends.reference import ReferenceBackend
from edgespec.drafters.base import DraftCost
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.drafters.tree_draft import side_tree
from edgespec.engine import Engine
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams
from edgespec.schedule import CostModel, Scheduler
from edgespec.schedule.acceptance import Calibration, SiblingRates
from edgespec.schedule.costs import K_MAX
from edgespec.schedule.trees import (
    TreeScheduling,
    best_sides,
    best_subtree,
    node_values,
    observe_nodes,
    observe_siblings,
    siblings_beside,
)
from edgespec.tree import DraftTree
from edgespec.tree_step import check_tree


def _tree() -> DraftTree:
    # chain 0 → 1 → 2; 3: an alternative to node 0; 4: an alternative to node 1; 5: node 3's child
    return DraftTree([10, 11, 12, 20, 21, 22], [-1, 0, 1, -1, 0, 3], confidence=[0.6, 0.7, 0.8, 0.3, 0.2, 0.9])


def test_node_values_multiply_calibrated_confidence_below_the_chains_survival():
    t, cal = _tree(), Calibration()
    v = node_values(t, [0, 1, 2], [0.6, 0.42, 0.336], cal, deepest=3)
    assert v[:3] == pytest.approx([0.6, 0.42, 0.336])
    assert v[3] == pytest.approx(0.3)  # a fresh calibration is the confidence itself
    assert v[4] == pytest.approx(0.6 * 0.2)
    assert v[5] == pytest.approx(0.3 * 0.9)
    assert node_values(t, [0, 1, 2], [0.6, 0.42, 0.336], cal, deepest=1)[[1, 2, 4, 5]].tolist() == [0, 0, 0, 0]


def test_best_subtree_takes_the_largest_values_while_they_pay():
    values = np.array([0.6, 0.42, 0.336, 0.3, 0.12, 0.27])
    flat = [0.0, *([10.0 + 0.01 * k for k in range(1, K_MAX + 1)])]  # T(k) flat: every node pays
    keep, tokens, ms = best_subtree(values, 1.0, flat)
    assert keep == [0, 1, 2, 3, 4, 5] and tokens == pytest.approx(1 + values.sum())
    steep = [0.0, *([10.0 * k for k in range(1, K_MAX + 1)])]  # T(k) = k·T(1): nothing pays
    assert best_subtree(values, 1.0, steep)[0] == []
    mid = [0.0, *([10.0 + 2.5 * (k - 1) for k in range(1, K_MAX + 1)])]
    keep = best_subtree(values, 0.0, mid)[0]
    assert keep == sorted(keep) and all(t_par in keep for i in keep if (t_par := _tree().parents[i]) >= 0)
    assert 0 < len(keep) < 6


def test_observe_nodes_calibrates_the_alternatives_whose_parent_was_reached():
    cal = Calibration()
    observe_nodes(cal, _tree(), [0, 1, 2], path=[3, 5])  # the walk left the chain at once: 3 then 5
    assert cal.tries.sum() == pytest.approx(2)  # 3 (root's child) and 5 (3's); 4's parent 0 was rejected
    assert cal.hits.sum() == pytest.approx(2)


def test_check_tree_takes_auto():
    assert check_tree("auto", "auto") == "auto" and check_tree("AUTO", 4) == "auto"
    with pytest.raises(EdgespecError, match="forced draft trees"):
        check_tree(8, "auto")


def _scheduler(t_forward: dict[int, float], prior: DraftCost | None) -> Scheduler:
    """A scheduler whose costs stay the given ones (the oracle's own timings would replace them)."""
    sched = Scheduler(CostModel.for_drafter(t_forward, prior), None)
    sched.cost.observe_verify = lambda *a, **k: None  # type: ignore[method-assign]
    sched.cost.observe_draft = lambda *a, **k: None  # type: ignore[method-assign]
    return sched


FLAT = {1: 10.0, 2: 10.2, 4: 10.5, 8: 11.0, 16: 12.0, 32: 14.0}
STEEP = {1: 10.0, 2: 20.0, 4: 40.0, 8: 80.0, 16: 160.0, 32: 320.0}


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_greedy_auto_trees_equal_plain_and_are_chosen_where_verification_is_flat(drafter_kind):
    target = ReferenceBackend(6, seed=5)
    if drafter_kind == "model":
        drafter, prior = DraftModelDrafter(target.perturbed(1.2), target.n_vocab), DraftCost(0.5, 1.0)
    else:
        drafter, prior = NgramDrafter(n_max=3, n_min=1), None
    engine = Engine(target, drafter, num_draft="auto", tree="auto")
    chosen = {}
    for name, t_forward in (("flat", FLAT), ("steep", STEEP)):
        sched, trees = TreeScheduling(_scheduler(t_forward, prior), 16), 0
        for prompt in PROMPTS:
            plain = engine.generate(prompt, max_tokens=48, speculative=False)
            spec = engine.generate(prompt, max_tokens=48, scheduler=sched)
            assert spec.tokens == plain.tokens, (name, prompt)
            trees += spec.stats.tree_cycles
        chosen[name] = trees
    assert chosen["flat"] > 0 and chosen["steep"] == 0, chosen


@pytest.mark.real
@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_greedy_auto_trees_equal_plain_on_llama(tiny_target, tiny_drafter, drafter_kind):
    """The same on the tiny llama target (backends.llama_tree), a flat T(k) so that trees are taken."""
    from test_tree_engine_llama import PROMPTS as LLAMA_PROMPTS

    from edgespec.backends.llama_cpp import LlamaCppBackend

    target = LlamaCppBackend(tiny_target, n_ctx=512, threads=1, tree_leaves=K_MAX - 1)
    if drafter_kind == "model":
        drafter = DraftModelDrafter(LlamaCppBackend(tiny_drafter, n_ctx=512, threads=1), target.n_vocab)
        prior: DraftCost | None = DraftCost(0.5, 1.0)
    else:
        drafter, prior = NgramDrafter(n_max=3, n_min=1), None
    trees = 0
    with Engine(target, drafter, num_draft="auto", tree="auto") as engine:
        sched = TreeScheduling(_scheduler(FLAT, prior), 16)
        for prompt in [*LLAMA_PROMPTS, "1 2 3 1 2 3 1 2 3 1 2"]:
            plain = engine.generate(prompt, max_tokens=48, speculative=False)
            spec = engine.generate(prompt, max_tokens=48, scheduler=sched)
            assert spec.tokens == plain.tokens, prompt
            trees += spec.stats.tree_cycles
    assert trees > 0


SIDE_COSTS = {1: 10.0, 2: 10.3, 4: 10.9, 8: 12.1, 16: 14.5, 32: 19.3}  # 0.3 ms a node: the cut keeps some siblings
FLAT_T = [0.0, *([10.0 + 0.01 * k for k in range(1, K_MAX + 1)])]  # T(k) flat: every node that may win pays


def _side_tree(seed: int) -> DraftTree:
    """A sampled side tree over a fixed chain and rows; `seed` draws only the siblings."""
    rows = np.array([[0.4, 0.3, 0.2, 0.1, 0.0], [0.1, 0.5, 0.2, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25, 0.0]])
    return side_tree([0, 1, 2], list(rows), 9, rows, np.random.default_rng(seed), confidence=[0.4, 0.5, 0.25])


def test_sampled_side_trees_are_cut_by_the_chain_alone():
    """Which nodes a sampled side tree keeps depends on the chain and the counts drawn, never on the
    siblings' tokens (the condition for lossless recursive rejection sampling): trees whose siblings
    differ keep the same nodes; each position keeps a prefix of its siblings, in draw order."""
    rates, survival = SiblingRates(), [0.4, 0.2, 0.05]
    kept = []
    for seed in range(6):
        t = _side_tree(seed)
        assert t.side_leaves and t.first_chain() == [0, 1, 2]
        sibs = siblings_beside(t, [0, 1, 2])
        sides = best_sides([len(s) for s in sibs], survival, rates, 1.0, FLAT_T)[0]
        kept.append(sides)
        assert all(j == 1 or (p, j - 1) in sides for p, j in sides)  # prefixes
    assert len({tuple(k) for k in kept}) == 1 and kept[0]
    assert len({tuple(t.tokens[3:]) for t in map(_side_tree, range(6))}) > 1  # the siblings drawn did differ


def test_best_sides_values_the_siblings_by_the_chains_misses():
    rates = SiblingRates()
    rates.hits[:], rates.tries[:] = 1e6 * 0.5, 1e6  # h_j = 0.5 at every rank
    sides, tokens, _ = best_sides([2, 1], [0.8, 0.4], rates, 0.0, FLAT_T)
    # position 0: 1·0.2·0.5, then 0.2·0.5·0.5; position 1: 0.8·0.5·0.5
    assert sorted(sides) == [(0, 1), (0, 2), (1, 1)]
    assert tokens == pytest.approx(1 + 0.8 + 0.4 + 0.1 + 0.05 + 0.2)
    assert best_sides([2, 1], [0.8, 0.4], rates, 0.0, [0.0, *([10.0 * k for k in range(1, K_MAX + 1)])])[0] == []


def test_observe_siblings_learns_where_the_walk_left_the_chain():
    t = DraftTree([5, 6, 7, 8, 9], [-1, 0, -1, 0, 0])  # chain 0 → 1; 2 beside 0; 3, 4 beside 1
    rates = SiblingRates()
    observe_siblings(rates, t, [0, 1], path=[0, 4])  # chain token 1 rejected, sibling 3 rejected, 4 accepted
    assert rates.tries[:2].tolist() == [1, 1] and rates.hits[:2].tolist() == [0, 1]
    observe_siblings(rates, t, [0, 1], path=[0, 1])  # the whole chain: no sibling tried
    observe_siblings(rates, t, [0, 1], path=[])  # 0 and its sibling 2 rejected
    assert rates.tries[:2].tolist() == pytest.approx([0.98 + 1, 1]) and rates.hits[0] == 0  # decayed, one more try


@pytest.mark.slow
def test_sampled_auto_side_trees_match_the_target_distribution():
    """Sampled, `tree="auto"` verifies priced side trees, most cut to some of the siblings drawn (a T(k)
    of 0.3 ms a node), alternatives accepted, and the first tokens keep the exact distribution (TV and
    chi-square, as the forced trees' test)."""
    from scipy.stats import chisquare
    from test_lossless_reference import _empirical, _exact_marginals

    from edgespec import tree_step
    from edgespec.schedule import trees as schedule_trees

    target, params, n_pos, draws = ReferenceBackend(6, seed=3, scale=0.8), SamplingParams(0.8, top_p=0.95), 3, 30_000
    prompt = target.tokenize("abcabcab")
    exact, paths = _exact_marginals(target, prompt, params, n_pos)
    engine = Engine(target, DraftModelDrafter(target.perturbed(1.2), target.n_vocab), num_draft="auto", tree="auto")
    sched, verify = TreeScheduling(_scheduler(SIDE_COSTS, DraftCost(0.5, 1.0)), 16), tree_step.verify_tree
    seen, cut, last = {"off": 0, "trees": 0, "cut": 0}, schedule_trees.best_sides, [False]

    def cutting(counts, *args):
        sides = cut(counts, *args)
        last[0] = len(sides[0]) < sum(counts)
        return sides

    def counting(logits, tree, params, rng):
        path, token = verify(logits, tree, params, rng)
        seen["trees"] += (sides := len(tree.first_chain()) < tree.n_nodes)
        seen["cut"] += sides and last[0]  # verified with some of the siblings drawn, not all
        seen["off"] += any(tree.parents[i] != i - 1 for i in path)  # chain node i's parent is i - 1
        return path, token

    tree_step.verify_tree, schedule_trees.best_sides = counting, cutting
    try:
        spec, pairs = _empirical(engine, prompt, params, n_pos, draws, scheduler=sched)
    finally:
        tree_step.verify_tree, schedule_trees.best_sides = verify, cut
    bound = 3 * np.sqrt(exact * (1 - exact) / draws).sum(axis=1)  # ~3 standard deviations of the TV
    for pos in range(n_pos):
        assert 0.5 * np.abs(spec[pos] - exact[pos]).sum() <= bound[pos], (pos, spec[pos], exact[pos])
    joint: dict[tuple[int, ...], float] = {}
    for path, pr in paths.items():
        joint[path[:2]] = joint.get(path[:2], 0.0) + pr
    keys = sorted(joint)
    expected, observed = np.array([joint[k] for k in keys]) * draws, np.array([pairs.get(k, 0) for k in keys])
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if (~big).any():
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    assert observed.sum() == draws and len(obs) >= 10 and chisquare(obs, exp).pvalue > 1e-3
    assert seen["cut"] > 0.1 * draws and seen["off"] > 0.01 * draws, seen  # siblings cut, and accepted


def test_sampled_drafters_without_side_trees_draft_chains():
    """Sampled, a drafter whose trees cannot be cut by the chain (no `sampled_trees`: EAGLE-3, Medusa) is
    asked for chains, not for trees it would drop; greedy, for trees."""
    class NoSideTrees(DraftModelDrafter):
        sampled_trees = False
        trees = 0

        def draft_tree(self, *args, **kw):
            NoSideTrees.trees += 1
            return super().draft_tree(*args, **kw)

    target = ReferenceBackend(6, seed=5)
    engine = Engine(target, NoSideTrees(target.perturbed(1.2), target.n_vocab), num_draft="auto", tree="auto")
    sched = TreeScheduling(_scheduler(FLAT, DraftCost(0.5, 1.0)), 16)
    sampled = engine.generate(PROMPTS[0], max_tokens=32, temperature=0.8, seed=1, scheduler=sched)
    assert NoSideTrees.trees == 0 and sampled.stats.n_drafted > 0 and sampled.stats.tree_cycles == 0
    engine.generate(PROMPTS[0], max_tokens=32, scheduler=sched)
    assert NoSideTrees.trees > 0
