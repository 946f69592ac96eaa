"""The target's last hidden state (after its final norm) from the MLX backend, in the same forward pass:
what Medusa heads read (drafters.medusa), as backends.llama_hidden gives it on llama.cpp.

The mlx-lm text models end their body ``model.model`` with their final norm, whose output the LM head
reads (``lm_head(self.model(...))``): ``return self.norm(h)`` (models/llama.py:197, gemma3_text, qwen2,
qwen3, qwen3_5), ``self.embedding_norm(h)`` (lfm2.py:287) or ``self.final_layernorm(h)`` (falcon_h1.py:436),
mlx-lm 0.32.2 (FINAL_NORMS). That module is wrapped (``tap_class``) to hand its output over as it is
computed: every forward of the backend (a prompt chunk with any ``rows``, a verification, a recurrent
target's checkpoint replay) and every draft tree mlx_tree scores. The logits come from the same graph, so
they are unchanged (tests/test_medusa_mlx.py). Other layouts (Mamba's ``backbone``) are refused in one line.

Unlike llama.cpp, whose last layer keeps only the rows whose logits were asked for, MLX computes the norm
for every row of a forward: every evaluated position p keeps its row h_p (a superset of llama_hidden's
contract, which a drafter reads at n_past − 1). A draft tree scored by mlx_tree.eval_tree leaves its rows
through ``note_tree`` (called there), and ``keep_tree_path`` (called by mlx_tree.keep_path) stores the
kept path's as the positions they now hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import LogitRows
from edgespec.backends.llama_features import FeatureStore
from edgespec.backends.mlx import MlxBackend
from edgespec.errors import BackendError, ModelLoadError

F32 = npt.NDArray[np.float32]
FINAL_NORMS = ("norm", "embedding_norm", "final_layernorm")  # the final norm of ``model.model``, by model type


def tap_class() -> type:
    """nn.Module wrapping a module (a final norm): runs it and hands its output to ``record``
    (mlx imported lazily)."""
    import mlx.nn as nn

    class TapNorm(nn.Module):
        def __init__(self, inner: Any, record: Callable[[Any], None]) -> None:
            super().__init__()
            self.inner = inner  # a child module: the parameter tree keeps the norm's weight
            self._record = record

        def __call__(self, x: Any) -> Any:
            y = self.inner(x)
            self._record(y)
            return y

        def __getattr__(self, key: str) -> Any:  # the norm's own attributes (its weight: a second tap sizes by it)
            if key in self or "inner" not in self:
                return super().__getattr__(key)
            return getattr(self["inner"], key)

    return TapNorm


class MlxHiddenBackend(MlxBackend):
    """An MLX target that also keeps its final-norm hidden state h_p for every position p it evaluated
    (``hidden(p)``).

    Args:
        path: as for MlxBackend (GGUF file or mlx-lm directory).
        **kwargs: as for MlxBackend.
    """

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        body = self.model["model"] if "model" in self.model else {}
        name = next((n for n in FINAL_NORMS if n in body), None)
        if name is None:
            raise ModelLoadError(f"model type {self.model_type!r} is not supported for Medusa heads: its mlx-lm "
                                 f"class has no final norm (model.{'/'.join(FINAL_NORMS)}) to read hidden states "
                                 f"from ({self.path})")
        self.n_embd = int(body[name].weight.shape[-1])
        self._captured: Any = None  # the norm's output in the last forward, (B, L, H)
        body[name] = tap_class()(body[name], self._record)
        self._store = FeatureStore(self.n_embd)  # row p: h of position p
        self._tree_rows: F32 | None = None  # note_tree's rows (root, then the nodes) until keep_tree_path

    def _record(self, h: Any) -> None:
        self._captured = h

    def _take(self, rows: int) -> F32:
        """The last forward's captured norm output as (rows, H) float32 (computed by that forward)."""
        h, self._captured = self._captured, None
        if h is None:
            raise BackendError(f"the forward pass of {self.path} never reached its final norm")
        h32 = h.reshape(rows, self.n_embd).astype(self._mx.float32)
        self._mx.eval(h32)
        return np.array(h32, copy=True)

    def _forward(self, chunk: list[int], want: LogitRows | Literal["argmax"]) -> npt.NDArray[Any] | None:
        self._captured = None
        logits = super()._forward(chunk, want)
        self._store.truncate(self._n_past)  # a recurrent replay re-evaluates positions already stored
        self._store.append(self._take(len(chunk)))
        return logits

    def note_tree(self, parents: Sequence[int]) -> None:
        """Keep the rows of the draft tree mlx_tree.eval_tree just scored (its batch axis: the root, then
        the n nodes) until ``keep_tree_path``."""
        self._tree_rows = self._take(len(parents) + 1)

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """After mlx_tree.keep_path(path): the rows of the root and the path's nodes become those of the
        last 1 + len(path) positions."""
        tree, self._tree_rows = self._tree_rows, None
        if tree is None:
            raise BackendError("keep_tree_path: no draft tree's hidden rows were noted")
        self._store.truncate(self.n_past - 1 - len(path))
        self._store.append(tree[[0, *(i + 1 for i in path)]])

    def truncate(self, n_past: int) -> None:
        super().truncate(n_past)
        self._store.truncate(self.n_past)

    def hidden(self, pos: int) -> F32 | None:
        """h of position `pos` (H,) float32 (a copy), or None when the target holds no row for it (not
        evaluated, or rolled back)."""
        if not 0 <= pos < min(self.n_past, len(self._store)):
            return None
        return self._store.rows(pos, pos + 1)[0]

    def output_matrix(self) -> F32:
        """The target's LM head (V, H) as float32 numpy (dequantized if quantized; the tied embeddings if
        tied): what Medusa heads that share it multiply by."""
        w = self.lm_head_weights().astype(self._mx.float32)
        self._mx.eval(w)
        return np.array(w, copy=True)
