"""Draft-tree verification on MLX: the target scores a whole tree in ONE forward of the mlx-lm model.

A tree is a root (the pending last committed token, not yet in the KV cache) and n nodes in
topological order, `parents[i]` node i's parent (-1: the root), as edgespec.tree.DraftTree holds
them. `eval_tree` returns n+1 logit rows: row 0 after the root, row i+1 after node i, where node i
sees the context, its ancestors and itself, at position n_past + depth (the root at n_past).
`keep_path` then commits the root and the accepted nodes; every other node leaves no trace.

How, without touching the model: the n+1 tree tokens go in the BATCH axis, one token each
(inputs (n+1, 1)), and every layer gets a stand-in for its KVCache (`_TreeCache`) speaking the cache
protocol the mlx-lm model classes use (mlx-lm 0.32.2):
  * `offset`: an mx.array of n+1 positions, n_past + depth. The attention layers pass it to RoPE
    (models/llama.py:90 Attention.__call__: `self.rope(queries, offset=cache.offset)`; the same in
    gemma3_text, qwen2, qwen3) and mx.fast.rope takes "a scalar or vector of B offsets for each
    example in the batch" (mlx 0.32 docs), the contract mlx-lm's own batched generation relies on
    (models/cache.py:905 BatchKVCache: `self.offset = mx.array(...)`). So each node is rotated at its
    depth, exactly as a chain would rotate it; with B = 1, L = n+1, positions could only be consecutive.
  * `make_mask(N, return_array=, window_size=)`: the model asks its cache for the mask
    (models/base.py:49 create_attention_mask: `if cache and hasattr(cache, "make_mask")`, called from
    LlamaModel / Gemma3Model.__call__, llama.py:187 and gemma3_text.py:195, with the sliding window
    where a layer slides). The stand-in returns a boolean (n+1, 1, 1, n_past+n+1) mask, the type
    mlx-lm's create_causal_mask makes: a node sees every context key (within the window) and the
    keys of its ancestors and itself (window counted in positions).
    mx.fast.scaled_dot_product_attention applies it as an additive 0 / -inf mask (models/base.py:132
    scaled_dot_product_attention).
  * `update_and_fetch(keys, values)`: the tree's (n+1, kv_heads, 1, d) keys/values are laid along the
    sequence axis and written after the context through the real KVCache, which returns the
    context + tree keys; they are broadcast to the n+1 batch rows (each query a single token).
After the forward the real caches are trimmed back to n_past (the tree is invisible to plain
decoding), and the tree's keys/values are kept aside until `keep_path` writes the rows of the root
and the accepted path after the context (KVCache.update_and_fetch) and sets n_past. A feature target
(backends.mlx_features, for EAGLE-3, DFlash and DSpark heads) keeps the tree's feature rows
(`note_tree`) and stores the kept path's (`keep_tree_path`).

Cost: the linear layers see the same n+1 rows as a chain; the attention reads the context once per
tree row (broadcast keys), like n+1 single-token decodes; for long contexts and wide trees that
costs more than one (n+1)-query attention would. Supported: attention-only models whose caches are
all mlx-lm KVCaches (sliding-window layers included: MlxBackend gives them full KVCaches) of the
model types in _TREE_MODEL_TYPES, whose source was checked for the protocol above; other types, a
RoPE that needs an integer offset (dynamic NTK) and recurrent targets are refused in one line.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import check_room
from edgespec.backends.mlx import MlxBackend
from edgespec.errors import BackendError

# model types whose attention rotates by `cache.offset` and whose masks come from `cache.make_mask`
_TREE_MODEL_TYPES = ("llama", "gemma3_text", "qwen2", "qwen3")


@dataclass(frozen=True)
class _Pending:
    """A tree evaluated and not yet committed: where its root sits, its shape, and each layer's
    keys/values of its n+1 rows, (1, kv_heads, n+1, d) (index 0: the root, i+1: node i)."""

    n_past: int
    parents: tuple[int, ...]
    kv: tuple[tuple[Any, Any], ...]


_pending: weakref.WeakKeyDictionary[MlxBackend, _Pending] = weakref.WeakKeyDictionary()
_checked: weakref.WeakKeyDictionary[MlxBackend, bool] = weakref.WeakKeyDictionary()


class _TreeCache:
    """One layer's KVCache as the tree forward sees it (module docstring): per-row positions, the
    tree mask, keys written after the context and broadcast to every row."""

    def __init__(self, kv: Any, offset: Any, masks: dict[int | None, Any]) -> None:
        self._kv, self.offset, self._masks = kv, offset, masks
        self.tree_kv: tuple[Any, Any] | None = None

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        return self._masks[window_size or None]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        rows = keys.shape[0]
        k, v = keys.transpose(2, 1, 0, 3), values.transpose(2, 1, 0, 3)  # rows along the sequence axis
        self.tree_kv = (k, v)
        ks, vs = self._kv.update_and_fetch(k, v)
        return mx.broadcast_to(ks, (rows, *ks.shape[1:])), mx.broadcast_to(vs, (rows, *vs.shape[1:]))


def _check(backend: MlxBackend) -> None:
    """BackendError in one line unless the tree forward above is exact for this model."""
    if backend.recurrent:
        raise BackendError(f"draft trees need an attention-only target: {backend.path} has recurrent layers")
    if backend in _checked:
        return
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    if backend.model_type not in _TREE_MODEL_TYPES:
        raise BackendError(f"draft trees on MLX support model types {', '.join(_TREE_MODEL_TYPES)}, "
                           f"not {backend.model_type!r} ({backend.path}); use --tree off")
    bad = [type(c).__name__ for c in backend._caches if not isinstance(c, KVCache)]
    if bad:
        raise BackendError(f"draft trees on MLX need KVCache layers; {backend.path} keeps a {bad[0]}")
    if any(isinstance(m, DynamicNTKScalingRoPE) for m in backend.model.modules()):
        raise BackendError(f"draft trees on MLX cannot use dynamic NTK RoPE (it needs an integer offset): "
                           f"{backend.path}")
    _checked[backend] = True


def _depths(parents: Sequence[int]) -> list[int]:
    """Depth of the root (index 0) and of each node (index i+1); checks the topological order."""
    depth = [0]
    for i, par in enumerate(parents):
        if not -1 <= par < i:
            raise ValueError(f"draft tree: node {i}'s parent {par} is neither -1 (the root) "
                             "nor an earlier node")
        depth.append(depth[par + 1] + 1)
    return depth


def _visible(n_past: int, parents: Sequence[int], depth: list[int],
             window: int | None) -> npt.NDArray[np.bool_]:
    """(n+1, n_past+n+1) bool: row r (0: the root, i+1: node i) sees context key j and tree row c
    iff c is r or an ancestor of r, and the key's position is less than `window` before r's."""
    rows = len(depth)
    anc = np.zeros((rows, rows), dtype=bool)
    anc[0, 0] = True
    for i, par in enumerate(parents):
        anc[i + 1] = anc[par + 1]
        anc[i + 1, i + 1] = True
    q_pos = n_past + np.asarray(depth)[:, None]
    k_pos = np.concatenate([np.arange(n_past), n_past + np.asarray(depth)])[None, :]
    mask = np.concatenate([np.ones((rows, n_past), dtype=bool), anc], axis=1)
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


def eval_tree(backend: MlxBackend, root: int, tokens: Sequence[int],
              parents: Sequence[int]) -> npt.NDArray[np.float32]:
    """The target's logits (n+1, n_vocab) float32 for the root and the n nodes (`tokens[i]` under
    `parents[i]`), scored in one forward with tree attention. backend.n_past does not change;
    `keep_path` commits the accepted path."""
    _check(backend)
    n = len(tokens)
    if len(parents) != n:
        raise ValueError(f"draft tree: {n} tokens but {len(parents)} parents")
    depth = _depths(parents)
    if n + 1 > backend.n_batch:
        raise BackendError(f"a draft tree of {n + 1} tokens does not fit one batch of {backend.n_batch}")
    n_past = backend.n_past
    check_room(n_past, n + 1, backend.n_ctx)
    drop_tree(backend)
    mx, model = backend._mx, backend.model
    offset = mx.array([n_past + d for d in depth], dtype=mx.int32)

    class _Masks(dict):  # one mask per window size the model asks for, built on first use
        def __missing__(self, window: int | None) -> Any:
            m = mx.array(_visible(n_past, parents, depth, window))[:, None, None, :]
            self[window] = m
            return m

    masks = _Masks()
    proxies = [_TreeCache(c, offset, masks) for c in backend._caches]
    inputs = mx.array([[int(t)] for t in (root, *tokens)])  # (n+1, 1): the tree in the batch axis
    try:
        if backend._split:
            h = model.model(inputs, cache=proxies)  # (n+1, 1, H)
            logits = backend.lm_head()(h)
        else:
            logits = model(inputs, cache=proxies)
        logits = logits[:, 0].astype(mx.float32)
        tree_kv = tuple(p.tree_kv for p in proxies)
        if any(kv is None for kv in tree_kv):
            raise BackendError(f"draft trees on MLX: model type {backend.model_type!r} "
                               "bypassed a layer's cache")
        mx.eval(logits, tree_kv, backend._cache_arrays())
        out = np.array(logits, copy=True)
        if hasattr(backend, "note_tree"):  # a feature target (mlx_features): the tree's feature rows
            backend.note_tree(parents)
    finally:
        for c in backend._caches:  # the tree stays out of the context until keep_path
            c.trim(c.offset - n_past)
    _pending[backend] = _Pending(n_past, tuple(int(p) for p in parents), tree_kv)
    return out


def keep_path(backend: MlxBackend, path: Sequence[int]) -> None:
    """Commit the root and the nodes of `path` (node indices from a child of the root down, as
    tree.verify_tree returns them) to the context, their keys/values written after it; the other
    nodes are forgotten. backend.n_past grows by 1 + len(path)."""
    pending = _pending.pop(backend, None)
    if pending is None or pending.n_past != backend.n_past:
        raise BackendError("keep_path: no draft tree evaluated at this position (call eval_tree first)")
    node = -1
    for i in path:
        if not 0 <= i < len(pending.parents) or pending.parents[i] != node:
            raise ValueError(f"keep_path: {list(path)} is not a path from the root of the evaluated tree")
        node = i
    mx = backend._mx
    rows = mx.array([0, *(int(i) + 1 for i in path)], dtype=mx.int32)
    for c, (k, v) in zip(backend._caches, pending.kv):
        c.update_and_fetch(mx.take(k, rows, axis=2), mx.take(v, rows, axis=2))
    mx.eval(backend._cache_arrays())
    backend._n_past = pending.n_past + len(path) + 1
    if hasattr(backend, "keep_tree_path"):
        backend.keep_tree_path(path)


def drop_tree(backend: MlxBackend) -> None:
    """Forget a pending tree (the caches never held it past n_past)."""
    _pending.pop(backend, None)
