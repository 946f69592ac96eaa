"""Draft-tree verification on llama.cpp (edgespec.backends.llama_tree): one llama_decode with tree
attention gives each node the logits of its own path evaluated as a plain chain; keep_path leaves the
cache as if only the accepted path had been evaluated; a context opened for trees decodes plain text
exactly as one that is not. Fixtures: the tiny F32 llama (conftest.tiny_target)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from recurrent_fixtures import recurrent_ggufs  # noqa: F401 (a fixture)
from tree_cases import random_tree, rel_err

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.llama_tree import drop_tree, eval_tree, keep_path, preorder, tree_seqs
from edgespec.errors import BackendError
from edgespec.tree import node_path

pytestmark = pytest.mark.real

LEAVES = 12  # width <= 3, depth <= 3, <= 12 nodes: at most 12 leaves
REL_TOL = 1e-4  # of the logit range of the row (F32 weights and KV cache)
PROMPT = "The weather today is sunny with a light breeze and"


def _backend(path: Path, leaves: int = LEAVES) -> LlamaCppBackend:
    return LlamaCppBackend(path, n_ctx=512, threads=1, kv_type="f32", tree_leaves=leaves)


def check_rows(ref: LlamaCppBackend, ctx: list[int], root: int, tokens: list[int], parents: list[int],
               rows: np.ndarray) -> float:
    """The worst relative error of the tree's rows against `ref` (a plain backend) evaluating root +
    each leaf's path as a chain after `ctx`."""
    ref.truncate(0)
    ref.eval(ctx, rows="none")
    worst = 0.0
    for leaf in [i for i in range(len(tokens)) if i not in parents] or [-1]:
        path = node_path(parents, leaf)
        want = ref.eval([root, *(tokens[i] for i in path)], rows="all")
        got = rows[[0, *(i + 1 for i in path)]]
        worst = max(worst, rel_err(got, want))
        ref.truncate(len(ctx))
    return worst


def test_tree_seqs():
    # root -> 0 -> {1, 2}; root -> 3: leaves 1, 2, 3 (index order) get seqs 1, 2, 3
    assert tree_seqs([-1, 0, 0, -1]) == [[1, 2, 3], [1, 2], [1], [2], [3]]
    assert tree_seqs([]) == [[1]]  # the root alone is the leaf
    assert tree_seqs([-1, 0, 1]) == [[1], [1], [1], [1]]  # a chain: one sequence
    with pytest.raises(ValueError, match="earlier node"):
        tree_seqs([-1, 1])
    # the batch order: depth first, children in index order
    assert preorder([-1, -1, 0, 1, 1, 2]) == [0, 1, 3, 6, 2, 4, 5]
    assert preorder([]) == [0]


def test_every_row_equals_its_path_as_a_chain(tiny_target: Path):
    """Random trees after a prompt, several on the same backend without keep_path (each drops the
    last): each node's row equals a plain chain eval of root + its path on the same context."""
    rng = np.random.default_rng(0)
    worst = 0.0
    with _backend(tiny_target) as b, _backend(tiny_target, leaves=0) as ref:
        ctx = b.tokenize(PROMPT)
        b.eval(ctx, rows="none")
        for _ in range(12):
            root = int(rng.integers(b.n_vocab))
            tokens, parents = random_tree(rng, b.n_vocab)
            rows = eval_tree(b, root, tokens, parents)
            assert rows.shape == (len(tokens) + 1, b.n_vocab) and rows.dtype == np.float32
            assert b.n_past == len(ctx)
            worst = max(worst, check_rows(ref, ctx, root, tokens, parents, rows))
    print(f"\ntree rows vs chains: max |Δ| / logit range = {worst:.2e}")
    assert worst < REL_TOL


def _walk(rng: np.random.Generator, parents: list[int], first_child: bool = False) -> list[int]:
    """A random accepted path from the root (possibly empty); `first_child`: always the first child."""
    path, node = [], -1
    while (kids := [i for i, p in enumerate(parents) if p == node]) and rng.random() < 0.8:
        node = kids[0 if first_child else int(rng.integers(len(kids)))]
        path.append(node)
    return path


def _rounds(b: LlamaCppBackend, rng: np.random.Generator, n: int, first_child: bool = False,
            ref: LlamaCppBackend | None = None, twin: LlamaCppBackend | None = None) -> tuple[list[int], float]:
    """`n` rounds of eval_tree + keep_path on `b` after PROMPT; the next root is the greedy token after
    the last accepted node. With `ref`: the worst error of the tree rows against chains on a clean
    cache. With `twin`: the same rounds with other tokens in every rejected node, rows compared bit
    for bit. Returns the committed tokens and the worst error."""
    committed = b.tokenize(PROMPT)
    b.eval(committed, rows="none")
    if twin is not None:
        twin.eval(committed, rows="none")
    root, worst = int(rng.integers(b.n_vocab)), 0.0
    for _ in range(n):
        tokens, parents = random_tree(rng, b.n_vocab)
        path = _walk(rng, parents, first_child)
        rows = eval_tree(b, root, tokens, parents)
        if ref is not None:
            worst = max(worst, check_rows(ref, committed, root, tokens, parents, rows))
        if twin is not None:
            other = [t if i in path else (t + 1 + int(rng.integers(100))) % b.n_vocab for i, t in enumerate(tokens)]
            rows2 = eval_tree(twin, root, other, parents)
            keep = [0, *(i + 1 for i in path)]  # the rows after tokens both trees share
            np.testing.assert_array_equal(rows[keep], rows2[keep])
            keep_path(twin, path)
        keep_path(b, path)
        committed += [root, *(tokens[i] for i in path)]
        assert b.n_past == len(committed)
        root = int(rows[path[-1] + 1 if path else 0].argmax())
    return committed, worst


def _plain_after(b: LlamaCppBackend, ref: LlamaCppBackend, committed: list[int], probe: list[int]) -> float:
    """Plain decoding of `probe` on `b` against `ref` holding only `committed`, then again after a
    rollback into the kept tokens: the worst relative error."""
    ref.truncate(0)
    ref.eval(committed, rows="none")
    worst = rel_err(b.eval(probe, rows="all"), ref.eval(probe, rows="all"))
    b.truncate(len(committed) - 3)
    ref.truncate(len(committed) - 3)
    return max(worst, rel_err(b.eval(probe, rows="all"), ref.eval(probe, rows="all")))


def test_keep_path_leaves_only_the_path(tiny_target: Path):
    """Rounds of eval_tree + keep_path of random paths (empty included): every tree's rows and then
    plain decoding match a backend that only ever saw the context, roots and accepted tokens, bit for
    bit (a path off the first-child chain is evaluated again in order: without that, the freed cells'
    holes reorder flash attention's sums, 3.7e-4 of the logit range here: llama_tree's note)."""
    rng = np.random.default_rng(1)
    with _backend(tiny_target) as b, _backend(tiny_target, leaves=0) as ref:
        committed, worst = _rounds(b, rng, 10, ref=ref)
        worst = max(worst, _plain_after(b, ref, committed, [int(t) for t in rng.integers(0, b.n_vocab, 6)]))
    print(f"\nafter keep_path of random paths vs a clean cache: max |Δ| / logit range = {worst:.2e}")
    assert worst == 0.0


def test_rejected_nodes_leave_no_trace(tiny_target: Path):
    """Two backends run the same rounds with different tokens in every rejected node: each later tree's
    rows and the plain decoding after them agree bit for bit, so no rejected cell stays visible."""
    rng = np.random.default_rng(2)
    with _backend(tiny_target) as b, _backend(tiny_target) as twin:
        committed, _ = _rounds(b, rng, 10, twin=twin)
        probe = [int(t) for t in rng.integers(0, b.n_vocab, 6)]
        np.testing.assert_array_equal(b.eval(probe, rows="all"), twin.eval(probe, rows="all"))


def test_first_child_chains_stay_exact(tiny_target: Path):
    """Accepted first-child chains (the batch's first cells, llama_tree.preorder) leave no hole before
    a kept cell: tree rows and later plain decoding equal a clean cache bit for bit."""
    rng = np.random.default_rng(3)
    with _backend(tiny_target) as b, _backend(tiny_target, leaves=0) as ref:
        committed, worst = _rounds(b, rng, 10, first_child=True, ref=ref)
        worst = max(worst, _plain_after(b, ref, committed, [int(t) for t in rng.integers(0, b.n_vocab, 6)]))
    assert worst == 0.0


def test_a_chain_equals_eval_all(tiny_target: Path):
    with _backend(tiny_target) as b, _backend(tiny_target, leaves=0) as ref:
        ctx = b.tokenize(PROMPT)
        b.eval(ctx, rows="none")
        ref.eval(ctx, rows="none")
        chain = [504, 2113, 6356, 17, 314]
        rows = eval_tree(b, 1, chain, list(range(-1, len(chain) - 1)))
        want = ref.eval([1, *chain], rows="all")
        print(f"\nchain vs eval(rows='all'): max |Δ| = {np.abs(rows - want).max():.2e}")
        np.testing.assert_allclose(rows, want, rtol=0, atol=REL_TOL * float(np.ptp(want)))
        # the root alone: one row; keep_path([]) commits the root
        keep_path(b, list(range(len(chain))))
        ref.truncate(len(ctx))
        ref.eval([1, *chain], rows="none")
        lone = eval_tree(b, 7, [], [])
        np.testing.assert_allclose(lone, ref.eval([7], rows="last"), rtol=0, atol=REL_TOL * float(np.ptp(lone)))
        keep_path(b, [])
        assert b.n_past == ref.n_past == len(ctx) + len(chain) + 2


def test_plain_decoding_is_unchanged_by_tree_leaves(tiny_target: Path):
    """A context opened for trees (unified KV, 13 sequences) decodes plain text bit for bit as one that
    is not: prompt rows, single steps and a rollback. Also with the default KV type (Q8_0)."""
    for kv in ("f32", "auto"):
        with (LlamaCppBackend(tiny_target, n_ctx=512, threads=1, kv_type=kv, tree_leaves=LEAVES) as a,
              LlamaCppBackend(tiny_target, n_ctx=512, threads=1, kv_type=kv) as b):
            assert a.n_ctx == b.n_ctx
            ctx = a.tokenize(PROMPT)
            np.testing.assert_array_equal(a.eval(ctx, rows="all"), b.eval(ctx, rows="all"))
            for tok in (504, 2113, 6356):
                np.testing.assert_array_equal(a.eval([tok]), b.eval([tok]))
            a.truncate(len(ctx) + 1)
            b.truncate(len(ctx) + 1)
            np.testing.assert_array_equal(a.eval([17, 314], rows="all"), b.eval([17, 314], rows="all"))


def test_refusals(tiny_target: Path, recurrent_ggufs):  # noqa: F811
    with _backend(tiny_target, leaves=2) as b:
        b.eval(b.tokenize(PROMPT), rows="none")
        n = b.n_past
        with pytest.raises(BackendError, match="tree_leaves >= 3"):
            eval_tree(b, 1, [2, 3, 4], [-1, -1, -1])
        with pytest.raises(BackendError, match="call eval_tree first"):
            keep_path(b, [])
        eval_tree(b, 1, [2, 3, 4], [-1, 0, 0])
        with pytest.raises(ValueError, match="not a path"):
            keep_path(b, [1])
        assert b.n_past == n
        eval_tree(b, 1, [2, 3], [-1, -1])
        drop_tree(b)
        with pytest.raises(BackendError, match="call eval_tree first"):
            keep_path(b, [0])
    with LlamaCppBackend(recurrent_ggufs["lfm2"][0], n_ctx=256, threads=1) as r:
        with pytest.raises(BackendError, match="attention-only target"):
            eval_tree(r, 1, [2], [-1])
