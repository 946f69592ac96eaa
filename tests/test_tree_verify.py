"""Draft-tree verification (edgespec.tree): structure, greedy, and losslessness of the sampled walk.

The sampled check runs 20k one-cycle verifications of trees drafted from a perturbed ReferenceBackend
and compares the first two emitted tokens with the target's exact joint distribution (chi-square and
TV); a deliberately wrong variant must fail the same check, so the check is shown to have power.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgespec import tree as tree_mod
from edgespec.backends.reference import ReferenceBackend
from edgespec.sampling import SamplingParams, process, sample
from edgespec.tree import DraftTree, node_path, verify_tree, verify_tree_greedy, verify_tree_stochastic
from edgespec.verify import verify_greedy, verify_stochastic

PROMPT = [0, 3, 1]


# --- structure ---------------------------------------------------------------------------------

def test_structure_of_a_small_tree():
    # root ─┬─ 0 (a) ─┬─ 2 (c)
    #       │         └─ 3 (d)
    #       └─ 1 (b) ─── 4 (a)
    t = DraftTree([0, 1, 2, 3, 0], [-1, -1, 0, 0, 1])
    assert t.n_nodes == 5 and t.depth == [1, 1, 2, 2, 2]
    assert t.children(-1) == [0, 1] and t.children(0) == [2, 3] and t.children(4) == []
    assert t.path(-1) == [] and t.path(3) == [0, 3] and t.path(4) == [1, 4]
    expected = np.array([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0],
                         [1, 1, 0, 0, 1, 0],
                         [1, 0, 1, 0, 0, 1]], dtype=bool)
    assert t.attention_mask().dtype == bool and (t.attention_mask() == expected).all()
    assert t.positions(10).tolist() == [10, 11, 11, 12, 12, 12]


def test_a_chain_is_the_width_one_tree():
    c = DraftTree.chain([4, 4, 2], confidence=[0.9, 0.5, 0.1])
    assert c.parents == [-1, 0, 1] and c.depth == [1, 2, 3] and c.path(2) == [0, 1, 2]
    assert (c.attention_mask() == np.tril(np.ones((4, 4), dtype=bool))).all()  # causal
    assert c.positions(7).tolist() == [7, 8, 9, 10]
    assert DraftTree.chain([]).attention_mask().shape == (1, 1)


@pytest.mark.parametrize("kwargs, words", [
    (dict(tokens=[1, 2], parents=[-1, 1]), "node 1's parent 1"),
    (dict(tokens=[1, 2], parents=[-1, -2]), "node 1's parent -2"),
    (dict(tokens=[1], parents=[]), "1 tokens but 0 parents"),
    (dict(tokens=[1, 3, 1], parents=[-1, -1, -1]), "nodes 0 and 2 are siblings with the same token 1"),
    (dict(tokens=[1, 2], parents=[-1, 0], q=np.full((3, 4), 0.25)), "q has shape (3, 4)"),
    (dict(tokens=[1, 2], parents=[-1, 0], q=np.eye(4)[[1, 1]]), "node 1's token 2 has no probability"),
    (dict(tokens=[1, 7], parents=[-1, 0], q=np.full((2, 4), 0.25)), "node 1's token 7"),
    (dict(tokens=[1], parents=[-1], confidence=[0.1, 0.2]), "1 tokens but 2 confidences"),
])
def test_invalid_trees_raise_one_line(kwargs, words):
    with pytest.raises(ValueError) as e:
        DraftTree(**kwargs)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


# --- greedy --------------------------------------------------------------------------------------

def test_greedy_walk_on_hand_made_logits():
    t = DraftTree([1, 2, 4, 0, 3], [-1, -1, 1, 1, 0])  # root → {1: node 0, 2: node 1}; node 1 → {4, 0}
    logits = np.eye(5)[[2, 1, 0, 4, 3, 0]]  # argmax of the rows: root 2, node 1 0, node 3 3
    assert verify_tree_greedy(logits, t) == ([1, 3], 3)  # 2, 0 accepted, bonus 3 after the leaf
    assert verify_tree_greedy(np.eye(5)[[2, 1, 4, 1, 3, 0]], t) == ([1, 2], 1)  # node 2's row: 1
    assert verify_tree_greedy(np.eye(5)[[3, 1, 0, 4, 3, 0]], t) == ([], 3)  # no child carries 3
    assert verify_tree_greedy(np.eye(5)[[1, 3, 0, 4, 3, 0]], t) == ([0, 4], 0)  # node 4's row: 0
    assert verify_tree(logits, t, SamplingParams(), np.random.default_rng(0)) == ([1, 3], 3)
    with pytest.raises(ValueError, match="needs 6 rows"):
        verify_tree_greedy(logits[:5], t)


def test_greedy_chain_equals_verify_greedy():
    rng = np.random.default_rng(0)
    for _ in range(300):
        gamma = int(rng.integers(0, 6))
        logits = rng.normal(size=(gamma + 1, 5))
        draft = [int(np.argmax(r)) if rng.random() < 0.7 else int(rng.integers(5)) for r in logits[:gamma]]
        n, token = verify_greedy(logits, draft)
        assert verify_tree_greedy(logits, DraftTree.chain(draft)) == (list(range(n)), token)


def _tree_logits(target: ReferenceBackend, t: DraftTree) -> np.ndarray:
    """The n+1 rows the target computes for tree t after PROMPT."""
    return np.stack([target.next_logits(PROMPT + [t.tokens[j] for j in t.path(i)])
                     for i in range(-1, t.n_nodes)])


def test_greedy_tree_follows_the_plain_argmax_chain_on_the_reference_model():
    target = ReferenceBackend(6, seed=5)
    rng = np.random.default_rng(1)
    long_paths = 0
    for _ in range(400):
        n = int(rng.integers(1, 12))
        tokens, parents = [], []
        for _ in range(n):
            par = int(rng.integers(-1, len(tokens)))
            taken = {x for x, up in zip(tokens, parents) if up == par}
            greedy = int(np.argmax(target.next_logits(PROMPT + [tokens[j] for j in node_path(parents, par)])))
            free = [x for x in range(6) if x not in taken]
            if not free:
                continue
            tokens.append(greedy if greedy in free and rng.random() < 0.6 else int(rng.choice(free)))
            parents.append(par)
        t = DraftTree(tokens, parents)
        path, token = verify_tree_greedy(_tree_logits(target, t), t)
        plain = PROMPT.copy()
        for _ in range(len(path) + 1):
            plain.append(int(np.argmax(target.next_logits(plain))))
        assert [t.tokens[i] for i in path] + [token] == plain[len(PROMPT):]
        assert path == (t.path(path[-1]) if path else [])
        assert token not in [t.tokens[c] for c in t.children(path[-1] if path else -1)]
        long_paths += len(path) >= 2
    assert long_paths > 20




# --- sampled -------------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(0.8), SamplingParams(1.0, top_p=0.9),
                                    SamplingParams(0.7, top_k=20)])
@pytest.mark.parametrize("one_hot", [False, True])
def test_stochastic_chain_is_verify_stochastic_draw_for_draw(params, one_hot):
    rng = np.random.default_rng(2)
    for seed in range(400):
        gamma, V = int(rng.integers(0, 5)), 40
        logits = rng.normal(0, 2, (gamma + 1, V)).astype(np.float32)
        q = np.stack([process(rng.normal(0, 2, V) + r, params) for r in logits[:gamma]]) if gamma else None
        draft = [int(np.argmax(r)) if one_hot else sample(r, rng) for r in (q if gamma else [])]
        q = None if one_hot or not gamma else q
        n, token = verify_stochastic(logits, draft, q, params, np.random.default_rng(seed))
        got = verify_tree(logits, DraftTree.chain(draft, q), params, np.random.default_rng(seed))
        assert got == (list(range(n)), token), (seed, draft)


class _Oracle:
    """A ReferenceBackend target and a perturbed drafter after PROMPT, rows cached by the tokens after it."""

    def __init__(self, n_vocab: int, params: SamplingParams, eps: float) -> None:
        self.target = ReferenceBackend(n_vocab, seed=3, scale=0.8)  # flatter than the default 1.5
        self.drafter, self.params = self.target.perturbed(eps, seed=4), params
        self._cache: dict[tuple, np.ndarray] = {}
        self._trees: dict[tuple, tuple[DraftTree, np.ndarray]] = {}

    def _row(self, kind: str, ctx: tuple[int, ...]) -> np.ndarray:
        """Kind l: the target's logits; p: its processed row; d: the drafter's logits; q: its processed row;
        g: log q (-inf outside q's kept set)."""
        key = (kind, *ctx)
        if key not in self._cache:
            if kind == "g":
                with np.errstate(divide="ignore"):
                    self._cache[key] = np.log(self.q(ctx))
            else:
                x = (self.target if kind in "lp" else self.drafter).next_logits(PROMPT + list(ctx))
                self._cache[key] = x if kind in "ld" else process(x, self.params)
        return self._cache[key]

    def logits(self, ctx):  # the target's raw row
        return self._row("l", ctx)

    def p(self, ctx):  # the target's processed row
        return self._row("p", ctx)

    def q(self, ctx):  # the drafter's processed row
        return self._row("q", ctx)

    def draft(self, widths: tuple[int, ...], rng: np.random.Generator,
              sampled: bool) -> tuple[DraftTree, np.ndarray]:
        """A tree of the given width per level and its n+1 target rows (both cached by its tokens). sampled:
        each node's children drawn without replacement from the drafter's processed row (every sibling's
        q row is that row); else the top-w tokens of the drafter's logits (deterministic, one-hot q)."""
        if not sampled:
            key: tuple = ("top",)
            if key not in self._trees:
                def top(ctx, w):
                    return np.argsort(-self._row("d", ctx), kind="stable")[:w]

                self._trees[key] = self._build(widths, top, False)
            return self._trees[key]
        kids, level = {}, [()]  # the tokens drawn below each context
        for w in widths:  # Gumbel-top-w: the order of successive draws without replacement from q
            logq = np.stack([self._row("g", c) for c in level])
            order = np.argsort(np.log(-np.log(rng.random(logq.shape))) - logq, axis=1)
            parents, level = level, []
            for c, row, lq in zip(parents, order, logq):
                kids[c] = xs = tuple(row[: min(w, int(np.isfinite(lq).sum()))].tolist())
                level += [(*c, x) for x in xs]
        key = tuple(kids.values())
        if key not in self._trees:
            self._trees[key] = self._build(widths, lambda ctx, w: kids[ctx], True)
        return self._trees[key]

    def _build(self, widths, children, sampled: bool) -> tuple[DraftTree, np.ndarray]:
        """The tree whose node at context c has the tokens children(c, w) below it, and its target rows."""
        tokens, parents, ctxs, frontier = [], [], [()], [(-1, ())]
        for w in widths:
            nxt = []
            for par, ctx in frontier:
                for x in children(ctx, w):
                    tokens.append(int(x))
                    parents.append(par)
                    ctxs.append((*ctx, int(x)))
                    nxt.append((len(tokens) - 1, ctxs[-1]))
            frontier = nxt
        q_rows = np.stack([self.q(ctxs[par + 1]) for par in parents]) if sampled else None
        return DraftTree(tokens, parents, q_rows), np.stack([self.logits(c) for c in ctxs])


def _first_two(oracle: _Oracle, widths, sampled: bool, draws: int, seed: int) -> tuple[np.ndarray, ...]:
    """Counts (V, V) of the first two tokens emitted by `draws` one-cycle tree verifications (a cycle that
    emitted one token is extended by plain sampling from the target), and the exact joint (V, V)."""
    rng, V = np.random.default_rng(seed), oracle.target.n_vocab
    counts = np.zeros((V, V))
    for _ in range(draws):
        t, logits = oracle.draft(widths, rng, sampled)
        path, token = verify_tree_stochastic(logits, t, oracle.params, rng)
        out = [t.tokens[i] for i in path] + [token]
        if len(out) < 2:
            out.append(sample(oracle.p((out[0],)), rng))
        counts[out[0], out[1]] += 1
    exact = np.stack([oracle.p(())[a] * oracle.p((a,)) for a in range(V)])
    return counts, exact


def _fit(counts: np.ndarray, exact: np.ndarray) -> tuple[float, float, float]:
    """(chi-square p-value, TV, TV bound) of the observed counts against the exact joint; the bound is
    Σ sqrt(p(1 − p)/N), about 2.5× the expected TV of N exact draws."""
    from scipy.stats import chisquare

    n = counts.sum()
    obs, exp = counts.ravel(), exact.ravel() * n
    assert obs[exp == 0].sum() == 0, "emitted a pair outside the target's support"
    big, rare = exp >= 5, (exp > 0) & (exp < 5)
    o, e = obs[big], exp[big]
    if rare.any():  # the rare cells pooled into one
        o, e = np.append(o, obs[rare].sum()), np.append(e, exp[rare].sum())
    e *= n / e.sum()  # the float32 rows' rounding: the exact joint sums to 1 within ~1e-7
    tv = 0.5 * np.abs(counts / n - exact).sum()
    return float(chisquare(o, e).pvalue), float(tv), float(np.sqrt(exact * (1 - exact) / n).sum())


DRAWS = 20_000
CASES = [  # (params, n_vocab, widths per level)
    (SamplingParams(0.7), 6, (3, 2)),
    (SamplingParams(1.0), 6, (2, 3)),
    (SamplingParams(1.0, top_k=5, top_p=0.9), 8, (3, 3)),
]


@pytest.mark.parametrize("sampled", [True, False], ids=["without-replacement", "deterministic"])
@pytest.mark.parametrize("params, n_vocab, widths", CASES)
def test_sampled_tree_verification_is_lossless(params, n_vocab, widths, sampled):
    oracle = _Oracle(n_vocab, params, eps=1.5)
    counts, exact = _first_two(oracle, widths, sampled, DRAWS, seed=7)
    pvalue, tv, bound = _fit(counts, exact)
    print(f"\n{params} V={n_vocab} widths={widths} sampled={sampled}: "
          f"p-value {pvalue:.3g}, TV {tv:.4f} (bound {bound:.4f})")
    assert pvalue > 1e-3 and tv < bound


def test_the_check_catches_siblings_q_not_renormalised(monkeypatch):
    """The same check on a wrong walk: later siblings' q rows zeroed at the earlier tokens but not
    renormalised (so they are accepted too often). It must fail: the check has power."""
    def zeroed_only(q_row, removed):
        out = q_row.copy()
        out[removed] = 0.0
        return out

    monkeypatch.setattr(tree_mod, "without", zeroed_only)
    oracle = _Oracle(6, SamplingParams(1.0), eps=1.5)
    counts, exact = _first_two(oracle, (3, 2), True, DRAWS // 4, seed=7)  # a quarter of the draws suffices
    pvalue, tv, bound = _fit(counts, exact)
    print(f"\nwrong variant (q_j not renormalised): p-value {pvalue:.3g}, TV {tv:.4f} (bound {bound:.4f})")
    assert pvalue < 1e-3
