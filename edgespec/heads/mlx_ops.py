"""Pieces the MLX heads share (heads/eagle3_mlx.py, heads/dflash_mlx.py): their weights (held
transposed), token embeddings borrowed from an MLX target, the SiLU-gated FFN and the d2t scatter back
to numpy (the numpy references' ops: heads/numpy_ops.py).

``mx`` is the mlx.core module the caller imported (backends.deps.import_mlx), so this module imports
no MLX itself and ``edgespec --help`` works without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.deps import import_mlx

F32 = npt.NDArray[np.float32]


class MlxHeadWeights:
    """What an MLX head holds from its config and GGUF tensors (MlxEagle3Head, MlxDFlashHead).

    Args:
        config: an Eagle3Config or DFlashConfig (``check_tensors``, n_vocab, n_embd, rms_eps).
        tensors: GGUF tensor name → array; ``d2t`` int64.
        tok_embd: the target's token embeddings (V, H), numpy or mx (an MLX target's own weight is
            used without a copy: MlxFeatureBackend.token_embeddings), used when ``tensors`` has no
            ``token_embd.weight``.

    Sets ``config``, ``tok_embd`` (mx), ``w`` (name → mx array, matrices (in, out)) and ``d2t``
    (None when V_d == V).
    """

    def __init__(self, config: Any, tensors: Mapping[str, npt.NDArray], tok_embd: Any) -> None:
        self._mx = mx = import_mlx()
        config.check_tensors(tensors)
        self.config = config
        self.tok_embd = mx_matrix(mx, tensors.get("token_embd.weight", tok_embd), (config.n_vocab, config.n_embd),
                                  "token embeddings")
        self.w = transposed_weights(mx, tensors, skip=("d2t", "token_embd.weight"))  # (in, out)
        self.d2t = np.asarray(tensors["d2t"], np.int64) if "d2t" in tensors else None

    def _norm(self, x: Any, name: str) -> Any:
        """ggml's RMSNorm of x × the weight tensor `name`."""
        return self._mx.fast.rms_norm(x, self.w[name], self.config.rms_eps)

    def close(self) -> None:
        """Nothing to free (the mx arrays go with the object)."""


def transposed_weights(mx: Any, tensors: Mapping[str, npt.NDArray], skip: Iterable[str]) -> dict[str, Any]:
    """GGUF tensor name → float32 mx array, matrices transposed to (in, out), evaluated.

    On MLX's CPU x @ W is faster than x @ Wᵀ of the GGUF layout for a head's output rows, hence the
    one-off transposed copy."""
    skipped = set(skip)
    w = {k: mx.array(np.ascontiguousarray(np.asarray(v, np.float32).T)) for k, v in tensors.items()
         if k not in skipped}
    mx.eval(w)
    return w


def mx_matrix(mx: Any, m: Any, shape: tuple[int, int], what: str) -> Any:
    """A (rows, H) matrix the head borrows (token embeddings, LM head) as an mx array: an mx array
    (an MLX target's own weight, MlxFeatureBackend.token_embeddings) is kept without a copy, numpy
    is converted to float32. ValueError unless its shape is `shape`. Evaluated here (a quantized
    target's rows dequantized now, not at first use): MLX streams are per thread, and an array left
    lazy on this thread cannot be evaluated on another (the engine's idle timing runs on its own)."""
    got = None if m is None else tuple(m.shape)
    if got != shape:
        raise ValueError(f"the head needs {what} of shape {shape} (its own or the target's; got {got})")
    out = m if isinstance(m, mx.array) else mx.array(np.asarray(m, np.float32))
    mx.eval(out)
    return out


def split_heads(y: Any, n: int, count: int, head_dim: int) -> Any:
    """(n, count·head_dim) → (1, count, n, head_dim), the layout of mx.fast's rope and attention."""
    return y.reshape(1, n, count, head_dim).transpose(0, 2, 1, 3)


def merge_heads(a: Any, n: int) -> Any:
    """(1, count, n, head_dim) → (n, count·head_dim)."""
    return a.transpose(0, 2, 1, 3).reshape(n, -1)


def silu_ffn(mx: Any, y: Any, gate: Any, up: Any, down: Any) -> Any:
    """down(silu(gate·y) ⊙ up·y), weights transposed (in, out)."""
    g = y @ gate
    return (g * mx.sigmoid(g) * (y @ up)) @ down


def to_target_vocab(z: F32, d2t: npt.NDArray[np.int64] | None, n_vocab: int) -> F32:
    """Draft-vocabulary logits (k, V_d) as target-vocabulary logits (k, V), −inf outside d2t
    (``d2t`` None: V_d == V, returned as is)."""
    if d2t is None:
        return z
    logits = np.full((len(z), n_vocab), -np.inf, np.float32)
    logits[:, d2t] = z
    return logits
