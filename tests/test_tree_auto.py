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
from edgespec.schedule.trees import TreeScheduling, best_subtree, node_values, observe_nodes
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
