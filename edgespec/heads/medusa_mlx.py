"""Medusa heads on MLX: heads.medusa's forward (``x ← x + SiLU(W x + b)`` per ResBlock, then the head's own
output matrix or the target's LM head) in mlx, one head at a time, for drafters.medusa on an MLX target.

Heads that share the target's LM head (``shared_lm_head``) call the target's own head (MlxBackend.lm_head:
its ``lm_head`` module or the tied embeddings' ``as_linear``, quantized or not), so no float32 copy of the
(V, H) matrix is made, and head k's logits are what the target's LM head makes of head k's state. The
ResBlocks and own output matrices are float32, held transposed (mlx_ops.transposed_weights).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.deps import import_mlx
from edgespec.heads.medusa import MedusaConfig, output_weight, res_bias, res_weight
from edgespec.heads.mlx_ops import transposed_weights

F32 = npt.NDArray[np.float32]


class MlxMedusaRunner:
    """K Medusa heads on MLX, with drafters.medusa.MedusaRunner's interface (``logits(h, k)``).

    Args:
        config: the heads' hyperparameters.
        tensors: GGUF tensor name → array (heads.medusa.MedusaConfig.shapes).
        lm_head: the target's LM head as a function of mx hidden states, (n, H) → (n, V) (MlxBackend.lm_head),
            needed when ``config.shared_lm_head``.
    """

    def __init__(self, config: MedusaConfig, tensors: Mapping[str, npt.NDArray[Any]],
                 lm_head: Callable[[Any], Any] | None = None) -> None:
        self._mx = mx = import_mlx()
        config.check_tensors(tensors)
        if config.shared_lm_head and lm_head is None:
            raise ValueError("Medusa heads sharing the target's LM head need it (got None)")
        self.config = config
        self.n_heads, self.n_embd, self.n_vocab = config.n_heads, config.n_embd, config.n_vocab
        w = transposed_weights(mx, tensors, skip=())  # matrices (in, out); biases as they are
        self._res = [[(w[res_weight(k, j)], w[res_bias(k, j)]) for j in range(config.n_layers)]
                     for k in range(config.n_heads)]
        self._lm_head = lm_head if config.shared_lm_head else None
        self._out = [] if config.shared_lm_head else [w[output_weight(k)] for k in range(config.n_heads)]  # (H, V)

    def logits(self, h: F32, k: int) -> F32:
        """Head k's logits (V,) float32 from the target's final-norm hidden state h (H,)."""
        mx = self._mx
        x = mx.array(np.asarray(h, np.float32)[None])  # (1, H)
        for w, b in self._res[k]:
            z = x @ w + b
            x = x + z * mx.sigmoid(z)  # SiLU
        y = (self._lm_head(x) if self._lm_head is not None else x @ self._out[k])[0].astype(mx.float32)  # (V,)
        mx.eval(y)
        return np.array(y, copy=True)


def mlx_on_gpu() -> bool:
    """Whether MLX computes on a GPU by default (Metal, CUDA), not on its CPU build."""
    mx = import_mlx()
    return mx.default_device() == mx.gpu
