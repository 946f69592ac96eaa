"""Draft-tree verification on MLX (edgespec.backends.mlx_tree): one forward with the tree in the batch
axis, per-row RoPE positions and a tree mask gives each node the logits of its own path evaluated as a
plain chain; keep_path leaves the cache as if only the accepted path had been evaluated. Tiny mlx-lm
models (mlx_fixtures): llama (split LM head), gemma3_text (sliding window 4, shorter than the
context), qwen3 (the whole model called; a config added here)."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_fixtures import _CONFIGS, build_tiny_mlx
from tree_cases import random_tree, rel_err

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

from edgespec.backends import mlx_tree  # noqa: E402
from edgespec.backends.mlx import MlxBackend  # noqa: E402
from edgespec.backends.mlx_tree import drop_tree, eval_tree, keep_path  # noqa: E402
from edgespec.backends.reference import ReferenceBackend  # noqa: E402
from edgespec.backends.trees import tree_ops  # noqa: E402
from edgespec.errors import BackendError, ContextOverflowError  # noqa: E402
from edgespec.tree import node_path  # noqa: E402

V = 16
REL_TOL = 1e-5  # of the logit range of a row (F32 weights; measured 0 on mlx[cpu])
QWEN3 = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=512,
             rope_theta=10000.0, tie_word_embeddings=False)
TYPES = ["llama", "gemma3_text", "qwen3"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_CONFIGS, "qwen3", QWEN3)
        return {t: build_tiny_mlx(tmp_path_factory.mktemp(t) / t, n_vocab=V, model_type=t, seed=3)
                for t in TYPES}


def _open(path, **kw) -> MlxBackend:
    return MlxBackend(path, vocab=ReferenceBackend(V), **kw)


def check_rows(ref: MlxBackend, ctx: list[int], root: int, tokens: list[int], parents: list[int],
               rows: np.ndarray) -> float:
    """The worst relative error of the tree's rows against `ref` evaluating root + each leaf's path as
    a chain after `ctx` (ref is reset to ctx from a fresh cache)."""
    ref.truncate(0)
    ref.eval(ctx, rows="none")
    worst = 0.0
    for leaf in [i for i in range(len(tokens)) if i not in parents] or [-1]:
        path = node_path(parents, leaf)
        want = ref.eval([root, *(tokens[i] for i in path)], rows="all")
        worst = max(worst, rel_err(rows[[0, *(i + 1 for i in path)]], want))
        ref.truncate(len(ctx))
    return worst


@pytest.mark.parametrize("model_type", TYPES)
def test_every_row_equals_its_path_as_a_chain(model_dirs, model_type):
    """Random trees on an empty context and after one (longer than gemma3's window), several on the
    same backend without keep_path: each row equals a plain chain eval of root + its path."""
    rng = np.random.default_rng(0)
    b, ref = _open(model_dirs[model_type]), _open(model_dirs[model_type])
    ctx: list[int] = []
    worst = 0.0
    for k in range(6):
        if k == 1:
            ctx = [int(t) for t in rng.integers(0, V, 9)]
            b.eval(ctx, rows="none")
        root = int(rng.integers(V))
        tokens, parents = random_tree(rng, V, max_nodes=10, depth=4)
        rows = eval_tree(b, root, tokens, parents)
        assert rows.shape == (len(tokens) + 1, V) and rows.dtype == np.float32
        assert b.n_past == len(ctx) and all(c.offset == len(ctx) for c in b._caches)
        worst = max(worst, check_rows(ref, ctx, root, tokens, parents, rows))
    print(f"\n{model_type}: tree rows vs chains: max |Δ| / logit range = {worst:.2e}")
    assert worst < REL_TOL


def _walk(rng: np.random.Generator, parents: list[int]) -> list[int]:
    """A random accepted path from the root (possibly empty)."""
    path, node = [], -1
    while (kids := [i for i, p in enumerate(parents) if p == node]) and rng.random() < 0.8:
        node = kids[int(rng.integers(len(kids)))]
        path.append(node)
    return path


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_keep_path_leaves_only_the_path(model_dirs, model_type):
    """Rounds of eval_tree + keep_path of random paths (empty included), a plain eval between two of
    them: every tree's rows, then plain decoding and a rollback into the kept tokens, match a backend
    that only ever saw the context, roots and accepted tokens."""
    rng = np.random.default_rng(1)
    b, ref = _open(model_dirs[model_type]), _open(model_dirs[model_type])
    committed = [int(t) for t in rng.integers(0, V, 5)]
    b.eval(committed, rows="none")
    root, worst = int(rng.integers(V)), 0.0
    for k in range(8):
        tokens, parents = random_tree(rng, V, max_nodes=10, depth=4)
        path = _walk(rng, parents)
        rows = eval_tree(b, root, tokens, parents)
        worst = max(worst, check_rows(ref, committed, root, tokens, parents, rows))
        keep_path(b, path)
        committed += [root, *(tokens[i] for i in path)]
        assert b.n_past == len(committed) and all(c.offset == len(committed) for c in b._caches)
        root = int(rows[path[-1] + 1 if path else 0].argmax())
        if k == 3:  # plain decoding between trees
            extra = [int(t) for t in rng.integers(0, V, 2)]
            b.eval(extra, rows="none")
            committed += extra
    ref.truncate(0)
    ref.eval(committed, rows="none")
    probe = [int(t) for t in rng.integers(0, V, 6)]
    worst = max(worst, rel_err(b.eval(probe, rows="all"), ref.eval(probe, rows="all")))
    b.truncate(len(committed) - 3)
    ref.truncate(len(committed) - 3)
    worst = max(worst, rel_err(b.eval(probe, rows="all"), ref.eval(probe, rows="all")))
    print(f"\n{model_type}: after keep_path vs a clean cache: max |Δ| / logit range = {worst:.2e}")
    assert worst < REL_TOL


def test_a_chain_equals_eval_all(model_dirs):
    """A width-1 tree gives eval(rows='all')'s rows; the root alone gives eval's last row; keep_path([])
    commits the root. Reached through trees.tree_ops, which dispatches MlxBackend to mlx_tree."""
    b, ref = _open(model_dirs["llama"]), _open(model_dirs["llama"])
    ops = tree_ops(b)
    assert ops._m is mlx_tree
    ctx = [3, 1, 4, 1, 5, 9, 2, 6]
    b.eval(ctx, rows="none")
    ref.eval(ctx, rows="none")
    chain = [5, 3, 5, 8, 9]
    rows = ops.eval_tree(2, chain, list(range(-1, len(chain) - 1)))
    want = ref.eval([2, *chain], rows="all")
    err = np.abs(rows - want).max()
    print(f"\nchain vs eval(rows='all'): max |Δ| = {err:.2e} (logit range {np.ptp(want):.2f})")
    np.testing.assert_allclose(rows, want, rtol=0, atol=REL_TOL * float(np.ptp(want)))
    ops.keep_path(list(range(len(chain))))
    lone = ops.eval_tree(7, [], [])
    np.testing.assert_allclose(lone, ref.eval([7], rows="last"), rtol=0, atol=REL_TOL * float(np.ptp(lone)))
    ops.keep_path([])
    assert b.n_past == ref.n_past == len(ctx) + len(chain) + 2
    np.testing.assert_allclose(b.eval([1, 2], rows="all"), ref.eval([1, 2], rows="all"), rtol=0, atol=1e-5)


def test_refusals_and_a_pending_tree_is_invisible(model_dirs, tmp_path):
    b, ref = _open(model_dirs["llama"], n_ctx=20, n_batch=8), _open(model_dirs["llama"])
    b.eval([1, 2, 3], rows="none")
    ref.eval([1, 2, 3], rows="none")
    with pytest.raises(BackendError, match="call eval_tree first"):
        keep_path(b, [])
    eval_tree(b, 1, [2, 3, 4], [-1, 0, 0])
    with pytest.raises(ValueError, match="not a path"):
        keep_path(b, [1])
    assert b.n_past == 3
    eval_tree(b, 1, [2, 3], [-1, -1])
    drop_tree(b)
    with pytest.raises(BackendError, match="call eval_tree first"):
        keep_path(b, [0])
    eval_tree(b, 1, [2, 3], [-1, 0])  # plain decoding with a tree pending: as if there were none
    np.testing.assert_allclose(b.eval([4, 5], rows="all"), ref.eval([4, 5], rows="all"), rtol=0, atol=1e-5)
    with pytest.raises(BackendError, match="call eval_tree first"):
        keep_path(b, [0])  # n_past moved
    with pytest.raises(ValueError, match="earlier node"):
        eval_tree(b, 1, [2, 3], [-1, 1])
    with pytest.raises(BackendError, match="one batch of 8"):
        eval_tree(b, 1, list(range(8)), [-1] * 8)
    b.eval(list(range(10)), rows="none")
    with pytest.raises(ContextOverflowError):
        eval_tree(b, 1, list(range(5)), [-1] * 5)  # 15 + 6 > 20
    assert b.n_past == 15 and all(c.offset == 15 for c in b._caches)
    other = _open(model_dirs["llama"])
    other.model_type = "phi3"  # a type whose source was not checked for the cache protocol
    with pytest.raises(BackendError, match="support model types llama.*not 'phi3'"):
        eval_tree(other, 1, [2], [-1])
    mamba = _open(build_tiny_mlx(tmp_path / "mamba", model_type="mamba", n_vocab=V))
    with pytest.raises(BackendError, match="attention-only target"):
        tree_ops(mamba)
    with pytest.raises(BackendError, match="attention-only target"):
        eval_tree(mamba, 1, [2], [-1])
