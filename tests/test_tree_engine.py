"""Draft trees through the engine (edgespec.tree_step): a draft model's chain with the alternatives
its own forwards rank next (drafters.tree_draft.side_tree), verified in one pass and accepted
losslessly: greedy output == plain output, token for token; sampled output has the target's
distribution (the exact one, enumerated on the reference oracle); the alternatives are accepted."""

from __future__ import annotations

import numpy as np
import pytest
from test_lossless_reference import PROMPTS, _empirical, _exact_marginals

from edgespec import tree_step
from edgespec.backends.reference import ReferenceBackend
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.tree_draft import side_tree
from edgespec.engine import Engine
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams
from edgespec.tree import DraftTree


@pytest.fixture
def off_chain(monkeypatch):
    """Counts the cycles whose accepted path left the chain (ended in an alternative)."""
    seen = {"off": 0, "cycles": 0}
    verify = tree_step.verify_tree

    def counting(logits, tree, params, rng):
        path, token = verify(logits, tree, params, rng)
        seen["cycles"] += 1
        seen["off"] += any(tree.parents[i] != i - 1 for i in path)  # chain node i's parent is i - 1
        return path, token

    monkeypatch.setattr(tree_step, "verify_tree", counting)
    return seen


@pytest.mark.parametrize("gamma, nodes", [(1, 3), (3, 8), (4, 16)])
def test_greedy_tree_equals_plain(gamma, nodes, off_chain):
    target = ReferenceBackend(6, seed=5)
    engine = Engine(target, DraftModelDrafter(target.perturbed(1.2), target.n_vocab), num_draft=gamma, tree=nodes)
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_tokens=64, speculative=False)
        spec = engine.generate(prompt, max_tokens=64)
        assert spec.tokens == plain.tokens, prompt
        assert spec.stats.n_cycles - 1 <= spec.stats.tree_cycles > 0  # the last cycle may have room for none
        assert max(d for d, _ in spec.stats.cycles) <= nodes
    assert off_chain["off"] > 0, off_chain  # alternatives were accepted, not only the chain


@pytest.mark.slow
@pytest.mark.parametrize("gamma, nodes", [(2, 6), (3, 9)])
def test_sampled_tree_matches_target_distribution(gamma, nodes, off_chain):
    from scipy.stats import chisquare

    # a flatter oracle than the greedy tests' (scale 0.8): two-token paths spread over ~20 outcomes
    target, params, n_pos, draws = ReferenceBackend(6, seed=3, scale=0.8), SamplingParams(0.8, top_p=0.95), 3, 30_000
    prompt = target.tokenize("abcabcab")
    exact, paths = _exact_marginals(target, prompt, params, n_pos)
    engine = Engine(target, DraftModelDrafter(target.perturbed(1.2), target.n_vocab), num_draft=gamma, tree=nodes)
    spec, pairs = _empirical(engine, prompt, params, n_pos, draws)
    bound = 3 * np.sqrt(exact * (1 - exact) / draws).sum(axis=1)  # ~3 standard deviations of the TV
    for pos in range(n_pos):
        assert 0.5 * np.abs(spec[pos] - exact[pos]).sum() <= bound[pos], (pos, spec[pos], exact[pos])
    joint: dict[tuple[int, ...], float] = {}
    for path, pr in paths.items():
        joint[path[:2]] = joint.get(path[:2], 0.0) + pr
    keys = sorted(joint)
    expected, observed = np.array([joint[k] for k in keys]) * draws, np.array([pairs.get(k, 0) for k in keys])
    assert observed.sum() == draws
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if (~big).any():  # pool the rare outcomes into one cell
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    assert len(obs) >= 10 and chisquare(obs, exp).pvalue > 1e-3
    assert off_chain["off"] > 0.01 * off_chain["cycles"], off_chain


def test_side_tree_shapes():
    dists = [np.array([0.5, 0.3, 0.2, 0.0]), np.array([0.1, 0.6, 0.25, 0.05])]
    t = side_tree([0, 1], dists, 5, None)  # greedy: the chain, then the best alternatives by reach × d
    assert t.tokens[:2] == [0, 1] and t.parents[:2] == [-1, 0]
    worth = {(t.parents[i], t.tokens[i]) for i in range(2, t.n_nodes)}
    assert worth == {(-1, 1), (-1, 2), (0, 2)}  # 0.3, 0.2 and 0.5·0.25 = 0.125 beat 0.5·0.1
    assert side_tree([0, 1], dists, 2, None).tokens == [0, 1]
    assert side_tree([0, 1, 2], dists + [dists[0]], 2, None).n_nodes == 2
    q = np.stack(dists)
    s = side_tree([0, 1], dists, 6, q, np.random.default_rng(0))
    assert s.q is not None and s.n_nodes <= 6
    for i in range(2, s.n_nodes):  # an alternative carries its position's row and is not the chain's token
        pos = s.parents[i] + 1
        assert np.array_equal(s.q[i], q[pos]) and s.tokens[i] != s.tokens[pos] and q[pos][s.tokens[i]] > 0


def test_within_depth_keeps_the_shallow_nodes():
    t = DraftTree([1, 2, 3, 4, 5], [-1, 0, 1, -1, 3])
    cut = tree_step.within_depth(t, 2)
    assert cut.tokens == [1, 2, 4, 5] and cut.parents == [-1, 0, -1, 2]
    assert tree_step.within_depth(t, 3) is t


def test_tree_options_fail_in_one_line():
    target = ReferenceBackend(6)
    drafter = DraftModelDrafter(target.perturbed(1.0), target.n_vocab)
    for bad in (-1, 0.5, "wide", 65):
        with pytest.raises(EdgespecError, match="tree must be") as e:
            Engine(target, drafter, num_draft=3, tree=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(EdgespecError, match="fixed num_draft"):
        Engine(target, drafter, tree=8).generate("abc", max_tokens=4)
    recurrent = ReferenceBackend(6, recurrent=True)
    with pytest.raises(EdgespecError, match="attention-only"):
        Engine(recurrent, DraftModelDrafter(recurrent.perturbed(1.0), 6), num_draft=3, tree=8).generate("abc", 4)
    assert Engine(target, drafter, num_draft=3, tree="off").generate("abc", max_tokens=8).stats.tree_cycles == 0


def test_ngram_tree_merges_earlier_continuations(off_chain):
    from edgespec.drafters.ngram import NgramDrafter

    ngram, greedy, rng = NgramDrafter(), SamplingParams(), np.random.default_rng(0)
    ctx = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 0, 1, 2]  # "1 2" was followed by 3 4, 5 6 and 3 7
    t = ngram.draft_tree(ctx, 16, 3, greedy, rng)
    first = [t.tokens[i] for i in t.path(max(range(t.n_nodes), key=lambda i: (t.depth[i], -i)))]
    assert first == ngram.draft(ctx, 3, greedy, rng).tokens == [3, 7, 0]  # the latest match leads
    assert sorted((t.parents[i], t.tokens[i]) for i in range(t.n_nodes)) == sorted(
        [(-1, 3), (0, 7), (1, 0), (-1, 5), (3, 6), (4, 1), (0, 4), (6, 1)])  # 3 7 0 | 5 6 1 | 3 → 4 1
    assert ngram.draft_tree(ctx, 4, 3, greedy, rng).n_nodes == 4
    assert ngram.draft_tree([1, 2, 3], 8, 3, greedy, rng).n_nodes == 0
    target = ReferenceBackend(6, seed=5)
    engine = Engine(target, NgramDrafter(), num_draft=4, tree=12)
    # prompts where a pair was followed by every letter: the oracle's next token (a function of the
    # last two) is one of the siblings, most often not the latest
    prompts = PROMPTS + ["".join(x + y + z for z in "abcdef") + x + y for x in "abc" for y in "def"]
    for prompt in prompts:
        assert engine.generate(prompt, max_tokens=64).tokens == engine.generate(prompt, 64, speculative=False).tokens
    assert off_chain["off"] > 0, off_chain
