"""Target features for feature heads (EAGLE-3) from the MLX backend, in the same forward pass.

The same features as backends/llama_features.py: the feature of target layer id L at position p is
the INPUT of transformer layer L for the token at p (the residual stream after layer L-1), the
layers concatenated in the order asked for. Each captured layer of ``model.model.layers`` is wrapped
in a module that records what the layer receives, then calls it; so a model whose embeddings are
scaled before the first layer (Gemma 3: × √H) gives the scaled stream, as llama.cpp's ``l_out``
tensors do. Valid ids are 1..n_layer-1, as there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import LogitRows
from edgespec.backends.llama_features import FeatureStore, StoredFeatures, eagle3_layer_ids
from edgespec.backends.mlx import MlxBackend
from edgespec.errors import BackendError, ModelLoadError


def _capture_layer_class() -> type:
    """nn.Module wrapping one transformer layer: records its input, then runs it (mlx imported lazily)."""
    import mlx.nn as nn

    class CaptureLayer(nn.Module):
        def __init__(self, layer: Any, record: Any) -> None:
            super().__init__()
            self.inner = layer  # a child module: the parameter tree keeps the layer's weights
            self._record = record  # (hidden state (1, L, H)) -> None

        def __call__(self, h: Any, *args: Any, **kwargs: Any) -> Any:
            self._record(h)
            return self.inner(h, *args, **kwargs)

        def __getattr__(self, key: str) -> Any:  # layer attributes the model reads (llama: use_sliding)
            if key in self or "inner" not in self:
                return super().__getattr__(key)
            return getattr(self["inner"], key)

    return CaptureLayer


class MlxFeatureBackend(StoredFeatures, MlxBackend):
    """An MLX target that also returns hidden states at a few layers for every evaluated token.

    Args:
        path: as for MlxBackend (GGUF file, mlx-lm directory or known model name).
        layers: target layer ids (features = input of each layer); default EAGLE-3's
            ``eagle3_layer_ids(n_layer)``.
        **kwargs: as for MlxBackend.

    A base.FeatureBackend, as LlamaFeatureBackend: ``feature_layers``, ``n_layer``, ``n_embd`` and
    ``features(start, stop)`` → (stop - start, len(layers) * n_embd) float32, one row per position
    for every ``eval`` (any ``rows``, chunked or not); ``truncate`` drops the rows past the new length.
    """

    def __init__(self, path: str | os.PathLike, *, layers: Sequence[int] | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        if self.recurrent:  # as on llama.cpp: a rollback's re-evaluation would append feature rows again
            raise ModelLoadError(f"feature heads need an attention-only target; model type {self.model_type!r} "
                                 "has recurrent layers")
        body = getattr(self.model, "model", None)
        blocks = getattr(body, "layers", None)
        if not isinstance(blocks, list) or not blocks:
            raise ModelLoadError(f"model type {self.model_type!r} is not supported for target features: "
                                 "its mlx-lm class has no model.layers list")
        self.n_layer = len(blocks)
        self.n_embd = int(body.args.hidden_size)
        ids = tuple(int(x) for x in layers) if layers is not None else eagle3_layer_ids(self.n_layer)
        bad = [lid for lid in ids if not 1 <= lid <= self.n_layer - 1]
        if not ids or bad:
            raise ValueError(f"feature layer ids must be in 1..{self.n_layer - 1} for this "
                             f"{self.n_layer}-layer model (got {list(ids)})")
        self.feature_layers = ids
        self._captured: dict[int, Any] = {}
        wrap = _capture_layer_class()
        for lid in sorted(set(ids)):
            blocks[lid] = wrap(blocks[lid], lambda h, lid=lid: self._captured.__setitem__(lid, h))
        self._store = FeatureStore(len(ids) * self.n_embd)
        self._tree_rows: npt.NDArray[np.float32] | None = None  # note_tree's rows until keep_tree_path

    def _forward(self, chunk: list[int], want: LogitRows | Literal["argmax"]) -> npt.NDArray[Any] | None:
        mx = self._mx
        self._captured.clear()
        logits = super()._forward(chunk, want)
        missing = [lid for lid in self.feature_layers if lid not in self._captured]
        if missing:  # cannot happen for a model that runs its layers in order: keep KV and rows in step
            for c in self._kv:
                c.trim(c.offset - self._n_past)
            raise BackendError(f"the forward pass never reached layer(s) {missing}")
        parts = [self._captured[lid][0].astype(mx.float32) for lid in self.feature_layers]  # (L, H) each
        rows = mx.concatenate(parts, axis=1)
        mx.eval(rows)  # the layer inputs were computed by the forward pass: this only gathers them
        self._captured.clear()
        self._store.append(np.asarray(rows))
        return logits

    def note_tree(self, parents: Sequence[int]) -> None:
        """Keep the feature rows of the draft tree mlx_tree.eval_tree just scored (its batch axis: the
        root, then the n nodes) until ``keep_tree_path``."""
        mx, n = self._mx, len(parents) + 1
        missing = [lid for lid in self.feature_layers if lid not in self._captured]
        if missing:
            self._captured.clear()
            raise BackendError(f"the tree's forward pass never reached layer(s) {missing}")
        parts = [self._captured[lid].reshape(n, -1).astype(mx.float32) for lid in self.feature_layers]
        rows = mx.concatenate(parts, axis=1)
        mx.eval(rows)
        self._captured.clear()
        self._tree_rows = np.asarray(rows)

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """After mlx_tree.keep_path(path): the feature rows of the root and the path's nodes become those
        of the last 1 + len(path) positions."""
        tree, self._tree_rows = self._tree_rows, None
        if tree is None:
            raise BackendError("keep_tree_path: no draft tree's feature rows were noted")
        self._store.append(tree[[0, *(i + 1 for i in path)]])
