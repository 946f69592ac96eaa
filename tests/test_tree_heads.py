"""Draft trees from feature heads (drafters.head_tree): EAGLE-3's dynamic tree (EAGLE-2), DFlash's and
DSpark's per-position alternatives. Greedy tree speculation == plain greedy, token for token, with trees
larger than the chain and alternatives accepted: on each kind's reference drafter (fast), on tiny heads
on llama.cpp and on MLX (real). Sampled trees obey tree.DraftTree's convention (siblings distinct, one q
row per sibling group, tokens with q > 0, confidences the conditional probabilities) and run through the
engine. (verify_tree's losslessness itself: tests/test_tree_verify.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from block_copy_heads import fit_bigram, write_block_copy_head
from head_cases import (
    BACKENDS,
    FIT_PROMPTS,
    GREEDY,
    HELD_OUT,
    KINDS,
    RUNTIMES,
    SAMPLED,
    chain_rows,
    greedy_lossless,
    reference,
)
from mlx_fixtures import own_mlx_home  # noqa: F401 (MLX targets convert their GGUFs into a module's own home)
from test_lossless_reference import PROMPTS, _empirical, _exact_marginals

import edgespec
from edgespec import tree_step
from edgespec.drafters.base import can_draft_trees
from edgespec.drafters.head_tree import dynamic_tree, rank_dist
from edgespec.engine import Engine
from edgespec.sampling import process
from edgespec.tree import DraftTree

GAMMA, NODES = 4, 16


@pytest.fixture
def trees(monkeypatch):
    """Every tree the engine verifies, and how many accepted paths left the first-child chain."""
    seen = {"trees": [], "off": 0}
    verify = tree_step.verify_tree

    def counting(logits, tree, params, rng):
        path, token = verify(logits, tree, params, rng)
        seen["trees"].append(tree)
        seen["off"] += any(tree.children(tree.parents[i])[0] != i for i in path)
        return path, token

    monkeypatch.setattr(tree_step, "verify_tree", counting)
    return seen


def _summary(stats, seen) -> tuple[float, int, int]:
    """(nodes per tree cycle, drafts accepted, tree cycles), asserting trees beat chains in size."""
    cycles = sum(s.tree_cycles for s in stats)
    nodes = [d for s in stats for d, _ in s.cycles]
    accepted = sum(s.n_accepted for s in stats)
    assert cycles > 0 and accepted > 0
    assert all(t.n_nodes <= NODES and max(t.depth, default=0) <= GAMMA for t in seen["trees"])
    per_cycle = sum(nodes) / len(nodes)
    assert per_cycle > GAMMA  # more than the chain
    return per_cycle, accepted, cycles


def check_convention(tree: DraftTree, sampled: bool, max_nodes: int, max_depth: int) -> None:
    """DraftTree's convention for a drafter's tree: topological, within budget, siblings distinct (the
    constructor checks), q None when greedy; sampled, siblings share one q row in which each has q > 0;
    confidences are each node's probability in the row it was drawn or ranked from."""
    assert 0 < tree.n_nodes <= max_nodes and max(tree.depth) <= max_depth
    assert all(-1 <= p < i for i, p in enumerate(tree.parents))
    assert tree.confidence is not None and all(0 < c <= 1 for c in tree.confidence)
    if not sampled:
        assert tree.q is None
        return
    assert tree.q is not None
    for node in [-1, *range(tree.n_nodes)]:
        kids = tree.children(node)
        for c in kids:
            assert np.array_equal(tree.q[c], tree.q[kids[0]])
            assert tree.q[c, tree.tokens[c]] > 0
            assert tree.confidence[c] == pytest.approx(tree.q[c, tree.tokens[c]])
        assert len({tree.tokens[c] for c in kids}) == len(kids)


# -- the reference drafters (fast) ----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tree_equals_plain_on_reference(kind, trees):
    ref = reference(kind)
    assert can_draft_trees(ref.drafter)
    stats = greedy_lossless(Engine(ref.target, ref.drafter, num_draft=GAMMA, tree=NODES), PROMPTS, 48)
    per_cycle, accepted, cycles = _summary(stats, trees)
    print(f"{kind}: {cycles} tree cycles, {per_cycle:.1f} nodes/cycle, {accepted} accepted, "
          f"{trees['off']} paths off the first-child chain")
    assert trees["off"] > 0  # alternatives, not only the chain, were accepted


def _parent_logits(drafter, ctx: list[int], tree: DraftTree, i: int) -> np.ndarray:
    """The head's logits after node i's parent's path (what node i was ranked or drawn from)."""
    path = tree.path(i)[:-1]
    if drafter.name == "eagle3":
        z, g = drafter.sync(ctx)
        drafter.head.truncate(len(ctx) - 1)
        for j in path:
            out, g = drafter.head.decode([tree.tokens[j]], g)
            z = out[0]
        return z
    rows, _ = chain_rows(drafter, ctx, [*(tree.tokens[j] for j in path), 0], GAMMA)  # DSpark: biased by the parent
    return rows[len(path)]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_trees_hold_the_chain_and_conditional_confidences(kind):
    """Greedy: a block kind's first γ nodes are draft()'s chain, EAGLE-3's first-child walk is a prefix
    of it; every confidence is the node's raw-softmax probability given its parent (not a product)."""
    ref = reference(kind)
    target, drafter = ref.target, ref.drafter
    for text in ["abcabc", "bbca", "cabbacab"]:
        ctx = target.tokenize(text)
        target.truncate(0)
        target.eval(ctx[:-1], rows="none")
        drawn = drafter.draft(ctx, GAMMA, GREEDY, np.random.default_rng(0))
        chain = drawn.tokens
        tree = drafter.draft_tree(ctx, NODES, GAMMA, GREEDY, np.random.default_rng(0))
        check_convention(tree, False, NODES, GAMMA)
        walk = [tree.tokens[i] for i in tree.first_chain()]
        assert tree.chain_draft.tokens == walk  # the tree's chain as a Draft (schedule.trees reads it)
        assert tree.chain_draft.confidence == pytest.approx(drawn.confidence[:len(walk)])
        if kind == "eagle3":
            assert walk and walk == chain[:len(walk)]
        else:
            assert tree.tokens[:len(chain)] == chain and tree.parents[:len(chain)] == list(range(-1, len(chain) - 1))
        assert tree.n_nodes > len(chain)
        for i in range(tree.n_nodes):  # conditional: the probability in the parent's row, not a product
            assert tree.confidence[i] == pytest.approx(rank_dist(_parent_logits(drafter, ctx, tree, i))[tree.tokens[i]])
        assert drafter.draft(ctx, GAMMA, GREEDY, np.random.default_rng(0)).tokens == chain  # draft() unchanged


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_trees_obey_the_convention_and_run(kind):
    ref = reference(kind, noise=0.5)
    target, drafter = ref.target, ref.drafter
    rng, wide = np.random.default_rng(7), 0
    for text in ["abcabc", "bbca", "cabbacab", "aaab"]:
        ctx = target.tokenize(text)
        target.truncate(0)
        target.eval(ctx[:-1], rows="none")
        for nodes, depth in [(16, 4), (5, 3), (1, 1)]:
            for _ in range(5):
                tree = drafter.draft_tree(ctx, nodes, depth, SAMPLED, rng)
                check_convention(tree, True, nodes, depth)
                wide += any(len(tree.children(i)) > 1 for i in range(-1, tree.n_nodes))
                if nodes == 16:
                    for i in range(tree.n_nodes):  # each row: the processed head row after the parent's path
                        want = process(_parent_logits(drafter, ctx, tree, i), SAMPLED)
                        np.testing.assert_allclose(tree.q[i], want, rtol=0, atol=1e-9)
    assert wide > 0
    engine = Engine(target, drafter, num_draft=GAMMA, tree=NODES)
    g = engine.generate("abcab", max_tokens=48, temperature=0.8, top_p=0.95, seed=3)
    assert len(g.tokens) == 48 and g.stats.tree_cycles > 0 and g.stats.n_accepted > 0
    again = engine.generate("abcab", max_tokens=48, temperature=0.8, top_p=0.95, seed=3)
    assert again.tokens == g.tokens  # seeded: reproducible


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_sampled_tree_matches_target_distribution(kind, trees):
    """Through the engine with each kind's sampled trees (3 deep, up to 9 nodes): the first three
    tokens' marginals within ~3σ of the exact ones and the first two tokens' joint by chi-square (as
    tests/test_tree_engine.py for draft models); the head cannot draft token 5, which the target samples."""
    from scipy.stats import chisquare

    ref, draws, n_pos = reference(kind, noise=0.5), 20_000, 3
    prompt = ref.target.tokenize("abcabcab")
    exact, paths = _exact_marginals(ref.target, prompt, SAMPLED, n_pos)
    spec, pairs = _empirical(Engine(ref.target, ref.drafter, num_draft=3, tree=9), prompt, SAMPLED, n_pos, draws)
    bound = 3 * np.sqrt(exact * (1 - exact) / draws).sum(axis=1)  # ~3 standard deviations of the TV
    tv = [0.5 * float(np.abs(spec[pos] - exact[pos]).sum()) for pos in range(n_pos)]
    print(f"{kind}: TV per position {np.round(tv, 4)} (bounds {np.round(bound, 4)}), "
          f"{trees['off']} of {len(trees['trees'])} paths off the first-child chain")
    assert all(tv[pos] <= bound[pos] for pos in range(n_pos)), (tv, bound)
    joint: dict[tuple[int, ...], float] = {}
    for path, pr in paths.items():
        joint[path[:2]] = joint.get(path[:2], 0.0) + pr
    keys = sorted(joint)
    expected, observed = np.array([joint[k] for k in keys]) * draws, np.array([pairs.get(k, 0) for k in keys])
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if (~big).any():  # pool the rare outcomes into one cell
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    assert chisquare(obs, exp).pvalue > 1e-3
    assert trees["off"] > 0.01 * len(trees["trees"])


def test_dynamic_tree_expands_the_best_nodes_and_reranks():
    """EAGLE-2 on a known model: every node's children distribution is the same 4-token one; greedy
    expands the top-k of each depth and keeps the max_nodes likeliest paths, as a subtree; sampled
    keeps within the budget per depth and draws without replacement."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    calls = []

    def expand(paths, tokens):
        calls.extend(tuple(t) for t in tokens)
        return [p] * len(paths)

    tree = dynamic_tree(p, expand, max_nodes=6, max_depth=3, sampled=False, rng=np.random.default_rng(0), top_k=2)
    # values: depth 1: .5 .3; depth 2: .25 .15 (under .5), .15 .09 (under .3); depth 3 under .25/.15 ...
    assert calls[:3] == [(0,), (1,), (0, 0)]
    paths = [tuple(tree.tokens[j] for j in tree.path(i)) for i in range(tree.n_nodes)]
    assert paths == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert tree.confidence == [0.5, 0.3, 0.5, 0.3, 0.5, 0.5]
    s = dynamic_tree(p, expand, max_nodes=6, max_depth=3, sampled=True, rng=np.random.default_rng(1), top_k=2)
    check_convention(s, True, 6, 3)
    assert [s.depth.count(d) for d in (1, 2, 3)] == [2, 2, 2]  # ⌈6/3⌉ per depth


# -- tiny heads on llama.cpp and MLX (real) -------------------------------------------------------


@pytest.fixture(scope="module")
def heads(tiny_head, smollm2_path, tmp_path_factory):
    """kind → (tiny target, head GGUF): the fitted EAGLE-3 head (head_cases.build_tiny_head) and, on its
    target, DFlash and DSpark heads that draft its bigrams (tests/block_copy_heads.py: the random tiny
    block heads are almost never right)."""
    target, eagle = tiny_head("eagle3")
    d, fit = tmp_path_factory.mktemp("copy_heads"), fit_bigram(target, FIT_PROMPTS)
    return {"eagle3": (target, eagle),
            **{k: (target, write_block_copy_head(k, fit, d / f"{k}.gguf", smollm2_path)) for k in ("dflash", "dspark")}}


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", KINDS)
def test_greedy_tree_equals_plain_on_a_tiny_target(heads, name, runtime, trees):
    target, head = heads[name]
    with edgespec.load(target, drafter=head, backend=BACKENDS[runtime], n_ctx=512, threads=1,
                       num_draft=GAMMA, tree=NODES) as engine:
        assert can_draft_trees(engine.drafter) and engine.drafter.name == name
        stats = greedy_lossless(engine, HELD_OUT[:3] if runtime == "llama" else HELD_OUT[:2], 32)  # MLX: slower here
        per_cycle, accepted, cycles = _summary(stats, trees)
        print(f"{name} on {runtime}: {cycles} tree cycles, {per_cycle:.1f} nodes/cycle, {accepted} accepted "
              f"({sum(s.n_drafted for s in stats)} nodes), {trees['off']} paths off the first-child chain")
        g = engine.generate(HELD_OUT[3], max_tokens=24, temperature=0.8, top_p=0.95, seed=5)
        assert len(g.tokens) == 24 and g.stats.tree_cycles > 0
    for t in trees["trees"][-g.stats.tree_cycles:]:
        check_convention(t, True, NODES, GAMMA)
    assert trees["off"] > 0  # alternatives, not only the chain, were accepted


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_sampled_rows_are_the_heads_processed_rows(heads, runtime):
    """A sampled EAGLE-3 tree's q row of a child of node i is the processed head distribution after
    node i's path, as a chain drafted along that path computes it (the replayed cache is the chain's)."""
    target_path, head = heads["eagle3"]
    with edgespec.load(target_path, drafter=head, backend=BACKENDS[runtime], n_ctx=256, threads=1,
                       num_draft=GAMMA, tree=NODES) as engine:
        drafter, target = engine.drafter, engine.target
        ctx = target.tokenize(HELD_OUT[0])
        target.eval(ctx[:-1], rows="none")
        tree = drafter.draft_tree(ctx, NODES, GAMMA, SAMPLED, np.random.default_rng(2))
        check_convention(tree, True, NODES, GAMMA)
        logits, h = drafter.sync(ctx)
        for i in range(tree.n_nodes):
            path = tree.path(i)
            drafter.head.truncate(len(ctx) - 1)
            z, g = logits, h
            for j in path[:-1]:
                out, g = drafter.head.decode([tree.tokens[j]], g)
                z = out[0]
            np.testing.assert_allclose(tree.q[i], process(z, SAMPLED), rtol=0, atol=2e-3)
        assert rank_dist(logits).sum() == pytest.approx(1.0)


@pytest.mark.real
@pytest.mark.parametrize("method, compiled", [("ext", True), ("cb_eval", True), ("cb_eval", False)])
def test_feature_rows_after_tree_cycles_are_the_plain_ones(heads, method, compiled, trees):
    """After tree cycles on llama.cpp (EAGLE-3's trees, alternatives accepted), the target's feature rows
    of the committed context are those a plain evaluation of it gives, for every capture: libllama's
    layer-input API (ext), the compiled and the Python cb_eval callbacks (llama_features.note_tree)."""
    from edgespec.backends.llama_features import LlamaFeatureBackend
    from edgespec.drafters.heads import open_head, read_head

    target_path, head = heads["eagle3"]
    opts = dict(layers=(2, 4, 5), method=method, compiled=compiled, n_ctx=256, threads=1)
    target = LlamaFeatureBackend(target_path, tree_leaves=NODES, **opts)
    engine = Engine(target, open_head(read_head(head), target), num_draft=GAMMA, tree=NODES)
    g = engine.generate(HELD_OUT[1], max_tokens=32)
    assert g.stats.tree_cycles > 0 and trees["off"] > 0
    kept, feats = list(engine._kv), target.features()
    assert len(kept) == target.n_past == len(feats)
    plain = LlamaFeatureBackend(target_path, **opts)
    plain.eval(kept, rows="none")
    want = plain.features()
    err = float(np.abs(feats - want).max() / np.abs(want).max())
    print(f"{method}{'' if compiled else ' (python)'}: feature rows after {g.stats.tree_cycles} tree cycles, "
          f"max |Δ| {err:.2e} of the largest")
    assert err < 1e-5  # measured 0.0 (bit for bit) with each capture
    plain.close()
    engine.close()


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
def test_feature_rows_after_tree_cycles_on_mlx(heads, trees):
    """As on llama.cpp: after tree cycles the MLX target's feature rows (mlx_features.note_tree) are
    those of a plain evaluation of the committed context, to float32 rounding."""
    pytest.importorskip("mlx.core")
    from edgespec.drafters.registry import open_backend

    target_path, head = heads["eagle3"]
    with edgespec.load(target_path, drafter=head, backend="mlx", n_ctx=256, threads=1, num_draft=GAMMA,
                       tree=NODES) as engine:
        g = engine.generate(HELD_OUT[1], max_tokens=24)
        assert g.stats.tree_cycles > 0 and trees["off"] > 0
        kept, feats = list(engine._kv), engine.target.features()
        assert len(kept) == engine.target.n_past == len(feats)
        plain = open_backend(engine.target.path, "mlx", (2, 4, 5), n_ctx=256)
        plain.eval(kept, rows="none")
        want = plain.features()
    err = float(np.abs(feats - want).max() / np.abs(want).max())
    print(f"mlx: feature rows after {g.stats.tree_cycles} tree cycles, max |Δ| {err:.2e} of the largest")
    assert err < 1e-4


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
def test_mlx_tree_step_equals_replay(heads, monkeypatch):
    """On MLX a depth of EAGLE-2's tree is one head step (MlxEagle3Head.decode_tree: per-row positions, an
    ancestor mask); it drafts the tree the one-node-at-a-time replay drafts, greedy and sampled."""
    pytest.importorskip("mlx.core")
    from edgespec.heads.eagle3_mlx import MlxEagle3Head

    target_path, head = heads["eagle3"]
    with edgespec.load(target_path, drafter=head, backend="mlx", n_ctx=256, threads=1, num_draft=GAMMA,
                       tree=NODES) as engine:
        drafter, target = engine.drafter, engine.target
        assert isinstance(drafter.head, MlxEagle3Head)
        steps = []
        tree_step_fn = MlxEagle3Head.decode_tree

        def counted(self, *a):
            steps.append(len(a[0]))
            return tree_step_fn(self, *a)

        monkeypatch.setattr(MlxEagle3Head, "decode_tree", counted)
        got = {}
        for text in HELD_OUT[:3]:
            ctx = target.tokenize(text)
            target.truncate(0)
            target.eval(ctx[:-1], rows="none")
            for params, seed in [(GREEDY, 0), (SAMPLED, 4)]:
                got[text, params.greedy] = [drafter.draft_tree(ctx, NODES, GAMMA, params, np.random.default_rng(seed))]
        assert 0 < len(steps) <= 2 * 3 * (GAMMA - 1) and max(steps) > 1  # one step per depth, several nodes each
        monkeypatch.setattr(MlxEagle3Head, "decode_tree", None)  # the drafter replays paths instead
        for text in HELD_OUT[:3]:
            ctx = target.tokenize(text)
            target.truncate(0)
            target.eval(ctx[:-1], rows="none")
            for params, seed in [(GREEDY, 0), (SAMPLED, 4)]:
                got[text, params.greedy].append(drafter.draft_tree(ctx, NODES, GAMMA, params,
                                                                   np.random.default_rng(seed)))
    for (text, greedy), (a, b) in got.items():
        assert a.tokens == b.tokens and a.parents == b.parents, (text, greedy)
        np.testing.assert_allclose(a.confidence, b.confidence, rtol=0, atol=1e-5)
        if not greedy:
            np.testing.assert_allclose(a.q, b.q, rtol=0, atol=1e-5)


@pytest.mark.real
def test_llama_tree_step_equals_replay(heads, monkeypatch):
    """On libllama too a depth of EAGLE-2's tree is one head step (LlamaEagle3Head.decode_tree: one sequence
    id per row holding the context's and its ancestors' cells, a unified cache); it drafts the tree the
    one-node-at-a-time replay drafts, greedy and sampled, and deeper than its ids last (reused oldest
    first), and leaves the head's cache as the replay does: the chain drafted after each tree is the
    replay's, bit for bit."""
    from edgespec.heads.eagle3_llama import TREE_SEQS, LlamaEagle3Head

    shapes = [(GREEDY, 0, NODES, GAMMA), (SAMPLED, 4, NODES, GAMMA),  # deep: up to 28 rows, 16 ids
              (GREEDY, 0, 4 * NODES - 1, 8), (SAMPLED, 4, 2 * NODES - 1, 8)]
    target_path, head = heads["eagle3"]
    with edgespec.load(target_path, drafter=head, n_ctx=256, threads=1, num_draft=GAMMA, tree=NODES) as engine:
        drafter, target = engine.drafter, engine.target
        assert isinstance(drafter.head, LlamaEagle3Head)
        steps, step_fn = [], LlamaEagle3Head.decode_tree

        def counted(self, *a):
            steps[-1].append(len(a[0]))
            return step_fn(self, *a)

        def draft_all() -> dict:
            out = {}
            for text in HELD_OUT[:3]:
                ctx = target.tokenize(text)
                target.truncate(0)
                target.eval(ctx[:-1], rows="none")
                for k, (params, seed, nodes, depth) in enumerate(shapes):
                    steps.append([])
                    tree = drafter.draft_tree(ctx, nodes, depth, params, np.random.default_rng(seed))
                    h = drafter.head  # the tree's entries are gone, its ids hold no cell
                    assert h.n_past == len(ctx) - 1 == h._ll.llama_memory_seq_pos_max(h._mem, 0) + 1
                    assert all(h._ll.llama_memory_seq_pos_max(h._mem, s) == -1 for s in range(1, TREE_SEQS + 1))
                    chain = drafter.draft(ctx, GAMMA, GREEDY, np.random.default_rng(0))
                    out[text, k] = tree, chain
            return out

        monkeypatch.setattr(LlamaEagle3Head, "decode_tree", counted)
        got = draft_all()
        rows = [s for s in steps if s]
        assert all(len(s) < depth for s, (_, _, _, depth) in zip(steps, shapes * 3, strict=True))  # one per depth
        assert max(map(max, rows)) > 1 and max(map(sum, rows)) > TREE_SEQS - 1  # several nodes; ids reused
        monkeypatch.setattr(LlamaEagle3Head, "decode_tree", None)  # the drafter replays paths instead
        want = draft_all()
    diff = max(max(abs(x - y) for x, y in zip(got[k][0].confidence, want[k][0].confidence, strict=True)) for k in got)
    print(f"libllama tree steps {rows}: max |Δ confidence| vs replay {diff:.1e}")
    for key, (a, chain) in got.items():
        b, chain_b = want[key]
        assert a.tokens == b.tokens and a.parents == b.parents, key
        # the same cells in the same order (a masked cell is skipped), but a depth's rows are multiplied
        # together, not one by one, and rounded otherwise: measured 7e-6 here (the deep trees; 1e-6 at
        # depth 4), 2e-4 with the shipped head on SmolLM2 (tokens and parents equal in 127 trees)
        np.testing.assert_allclose(a.confidence, b.confidence, rtol=0, atol=1e-4)
        if a.q is not None:
            np.testing.assert_allclose(a.q, b.q, rtol=0, atol=1e-4)
        assert chain.tokens == chain_b.tokens and chain.confidence == chain_b.confidence, key


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", KINDS)
def test_greedy_auto_trees_equal_plain_on_a_tiny_target(heads, name, runtime):
    """`--tree auto` with each head on llama.cpp and MLX (schedule.trees on a flat T(k), so that trees
    are taken): greedy output == plain output, token for token."""
    from dataclasses import replace

    from test_tree_auto import FLAT, _scheduler

    from edgespec.schedule.trees import TreeScheduling

    target, head = heads[name]
    with edgespec.load(target, drafter=head, backend=BACKENDS[runtime], n_ctx=512, threads=1, num_draft="auto",
                       tree="auto") as engine:
        # the head's own block shape, at a price that pays on FLAT (its timing here depends on the load)
        prior = replace(engine.drafter.cost_prior(), fixed_ms=0.5, per_token_ms=0.1)
        sched, trees = TreeScheduling(_scheduler(FLAT, prior), 16), 0
        for prompt in HELD_OUT[:3] if runtime == "llama" else HELD_OUT[:2]:  # MLX: slower here
            plain = engine.generate(prompt, max_tokens=32, speculative=False)
            spec = engine.generate(prompt, max_tokens=32, scheduler=sched)
            assert spec.tokens == plain.tokens, prompt
            trees += spec.stats.tree_cycles
        print(f"{name} on {runtime}: {trees} tree cycles under --tree auto, drafted {spec.stats.n_drafted} in {spec.stats.n_cycles} cycles, accepted {spec.stats.n_accepted}")
        assert trees > 0


@pytest.mark.real
def test_eagle3_head_syncs_prompts_longer_than_its_batch(heads, trees):
    """Prompts longer than the head's n_batch (the target's) on llama.cpp, one after another with a
    common prefix, with trees: greedy output == plain, and after every generation the head's KV cache
    holds exactly its n_past positions. Regression: the sync encoded a later chunk of feature rows at
    positions n_past + n_batch.., which libllama refuses (-1, Y = X + 1) whenever the cache holds a
    position (the encoder stores none), and refused to decode more than n_batch pairs (ValueError):
    the first spec-bench prompt over 512 tokens crashed a recording with the shipped head."""
    from edgespec.backends.llama_features import LlamaFeatureBackend
    from edgespec.drafters.heads import open_head, read_head

    target_path, head = heads["eagle3"]
    target = LlamaFeatureBackend(target_path, layers=(2, 4, 5), n_ctx=512, n_batch=32, threads=1, tree_leaves=NODES)
    engine = Engine(target, open_head(read_head(head), target), num_draft=GAMMA, tree=NODES)
    h = engine.drafter.head
    long = " ".join(HELD_OUT * 4)
    prompts = [long, HELD_OUT[0] + ", " + " ".join(reversed(HELD_OUT * 4)), long + " " + HELD_OUT[1]]
    assert h.n_batch == 32 and all(len(target.tokenize(p)) > 2 * h.n_batch for p in prompts)
    for p in prompts:
        stats = greedy_lossless(engine, [p], 24)
        assert h._ll.llama_memory_seq_pos_max(h._mem, 0) == h.n_past - 1 and h.n_past > 2 * h.n_batch
    assert stats[0].tree_cycles > 0 and len(trees["trees"]) > 0
    # more pairs than a batch with every output: the rows a batch at a time, the last as rows="last" gives it
    n0, toks = h.n_past, target.tokenize(long)[:2 * h.n_batch + 3]
    g = np.random.default_rng(0).standard_normal((len(toks), h.n_embd)).astype(np.float32)
    z_all, h_all = h.decode(toks, g)
    h.truncate(n0)
    z_last, h_last = h.decode(toks, g, rows="last")
    assert z_all.shape == (len(toks), h.n_vocab) and h_all.shape == (len(toks), h.n_embd) and h.n_past == n0 + len(toks)
    np.testing.assert_allclose(z_all[-1:], z_last, rtol=0, atol=1e-3)
    np.testing.assert_allclose(h_all[-1:], h_last, rtol=0, atol=1e-3)
    engine.close()
