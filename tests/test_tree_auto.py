"""Trees priced every cycle (`tree="auto"`, edgespec.schedule.trees): the pricing's parts, and the engine
with a tree scheduler: greedy output == plain output, token for token, whichever of tree and chain each
cycle verifies; trees are chosen where the verification cost is flat and chains where it is steep."""

from __future__ import annotations

import numpy as np
import pytest
from test_lossless_reference import PROMPTS

from edgespec.backends.reference import ReferenceBackend
from edgespec.drafters.base import DraftCost
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.errors import EdgespecError
from edgespec.schedule import CostModel, Scheduler
from edgespec.schedule.acceptance import Calibration
from edgespec.schedule.costs import K_MAX
from edgespec.schedule.rate import best_gamma
from edgespec.schedule.trees import TREE_MARGIN, SideHits, TreeScheduling, best_subtree, node_values, observe_nodes
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


def test_side_hits_count_the_target_token_among_the_chain_nodes_siblings():
    side, t = SideHits(8), _tree()  # root's children: 0 (chain), 3; node 0's: 1 (chain), 4
    side.observe(t, [10, 21, 7])  # chain right at depth 1, the target's token at depth 2 is node 4: rank 2
    side.observe(t, [20, 22])  # the root's second child: rank 2 (its child is not judged: off the chain)
    side.observe(t, [10, 11, 12, 5])  # the whole chain right, nothing drafted below it: no miss
    side.observe(t, [99])  # a miss none of the alternatives holds
    assert side.misses == 3 and side.rates()[2] == pytest.approx(2 / 4) and side.rates()[8] == pytest.approx(2 / 4)


def test_side_hits_plan_a_tree_where_the_chain_alone_does_not_pay():
    side = SideHits(K_MAX - 1)
    side.hits[2:5], side.misses = 10, 39  # the target's token is each of ranks 2, 3, 4 a quarter of the misses
    flat = [0.0, *([10.0 + 0.05 * k for k in range(1, K_MAX + 1)])]
    t_draft = [0.0, *([1.5 * g for g in range(1, K_MAX)])]
    survival = [0.1 ** d for d in range(1, 6)]  # a weak head: right 10% of the time
    assert best_gamma(survival, t_draft, flat)[0] == 0  # as a chain it never pays
    gamma, rate = side.plan(survival, t_draft, flat)
    assert gamma == 1 and rate > 1 / flat[1]  # one level of 4 candidates: 1 + 0.1 + 0.75·0.9·... pays
    assert rate == pytest.approx((1 + 0.1 + 0.75 * 0.9) / (1.5 + flat[1 + 4]) / (1 + TREE_MARGIN))
    steep = [0.0, *([10.0 * k for k in range(1, K_MAX + 1)])]
    assert side.plan(survival, t_draft, steep)[1] < 1 / steep[1]  # T(k) = k·T(1): no tree pays either
    a = np.array([0.1, 0.9])
    cost = CostModel({k: flat[k] for k in range(1, K_MAX + 1)}, draft_per_token_ms=1.5)
    sums = np.cumsum(a[:, None] ** np.arange(16), axis=-1)
    assert side.speedup(cost, a, sums, 15)[0] == pytest.approx(  # the same tree, without plan's margin
        side.plan(survival, cost.t_draft(), cost.t_verify())[1] * cost.t_verify()[1] * (1 + TREE_MARGIN))


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
