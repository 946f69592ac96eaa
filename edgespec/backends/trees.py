"""Draft-tree verification, one protocol over the backends (edgespec.tree holds the tree and its
acceptance): the target scores a root and a tree of nodes in one forward with tree attention, then
keeps the accepted path.

A tree is a root (the pending last committed token, not yet in the target's cache) and n nodes in
topological order, `parents[i]` node i's parent (-1: the root). `eval_tree` returns n+1 logit rows:
row 0 after the root, row i+1 after node i, where node i sees the context, its ancestors and itself
(at position n_past + its depth). The target's n_past does not change until `keep_path(path)` commits
the root and the accepted nodes (a path from a child of the root down, as tree.verify_tree returns it)
and drops the rest; `drop_tree` forgets a tree that is not kept.

`tree_ops(backend)` gives the implementation for a backend: llama.cpp (backends.llama_tree: one
sequence per leaf), MLX (backends.mlx_tree: an explicit attention mask) and the reference oracle
(here: exact rows from its tables). A recurrent target cannot branch its state: a one-line error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import Backend
from edgespec.errors import BackendError


class TreeOps(Protocol):
    def eval_tree(self, root: int, tokens: Sequence[int], parents: Sequence[int]) -> npt.NDArray[np.float32]: ...

    def keep_path(self, path: Sequence[int]) -> None: ...

    def drop_tree(self) -> None: ...


class _Bound:
    """A module's (eval_tree, keep_path, drop_tree)(backend, ...) functions bound to one backend."""

    def __init__(self, backend: Backend, module) -> None:
        self.backend, self._m = backend, module

    def eval_tree(self, root: int, tokens: Sequence[int], parents: Sequence[int]) -> npt.NDArray[np.float32]:
        return self._m.eval_tree(self.backend, root, tokens, parents)

    def keep_path(self, path: Sequence[int]) -> None:
        self._m.keep_path(self.backend, path)

    def drop_tree(self) -> None:
        self._m.drop_tree(self.backend)


class _Reference:
    """Tree rows of the reference oracle, exact: each node's logits from its own context (the
    oracle has no cache to share); keep_path evaluates the kept tokens."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def eval_tree(self, root: int, tokens: Sequence[int], parents: Sequence[int]) -> npt.NDArray[np.float32]:
        b = self.backend
        if b.n_past + len(tokens) + 1 > b.n_ctx:
            b.eval([0] * (len(tokens) + 1), rows="none")  # raises the backend's own overflow error
        ctx = [*b._tokens, root]
        paths: list[list[int]] = []
        for t, par in zip(tokens, parents):
            if not -1 <= par < len(paths):
                raise ValueError(f"draft tree: parent {par} is neither -1 (the root) nor an earlier node")
            paths.append([*(paths[par] if par >= 0 else []), int(t)])
        b.n_evals += 1
        self._pending = (b.n_past, int(root), [int(t) for t in tokens], list(parents))
        return np.stack([b.next_logits(ctx)] + [b.next_logits(ctx + p) for p in paths])

    def keep_path(self, path: Sequence[int]) -> None:
        n_past, root, tokens, parents = self.__dict__.pop("_pending", (None,) * 4)
        if n_past != self.backend.n_past:
            raise BackendError("keep_path: no draft tree evaluated at this position (call eval_tree first)")
        node = -1
        for i in path:
            if not 0 <= i < len(tokens) or parents[i] != node:
                raise ValueError(f"keep_path: {list(path)} is not a path from the root of the evaluated tree")
            node = i
        self.backend._tokens.extend([root, *(tokens[i] for i in path)])

    def drop_tree(self) -> None:
        self.__dict__.pop("_pending", None)


def tree_ops(backend: Backend) -> TreeOps:
    """The tree verification of `backend`'s runtime (module docstring). Raises BackendError in one
    line for a recurrent target or a runtime without tree attention."""
    if backend.recurrent:
        raise BackendError(f"draft trees need an attention-only target: {backend.path} has recurrent layers; "
                           "use --tree off")
    from edgespec.backends.reference import ReferenceBackend

    if isinstance(backend, ReferenceBackend):
        return _Reference(backend)
    try:
        from edgespec.backends.llama_cpp import LlamaCppBackend

        if isinstance(backend, LlamaCppBackend):
            from edgespec.backends import llama_tree

            return _Bound(backend, llama_tree)
    except ImportError:  # the llama extra is not installed
        pass
    try:
        from edgespec.backends.mlx import MlxBackend

        if isinstance(backend, MlxBackend):
            from edgespec.backends import mlx_tree

            return _Bound(backend, mlx_tree)
    except ImportError:
        pass
    raise BackendError(f"draft trees are not supported on the {backend.name} backend; use --tree off")
