"""Numpy ops of the numpy EAGLE-3 forward (heads/eagle3.py; the tests' DFlash oracle shares them):
ggml's RMSNorm, RoPE in mode 0, attention with GQA and SiLU, computed in float64 and returned as
float32 so the references stay within float32 rounding of llama.cpp (the MLX heads' ops: heads/mlx_ops.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


class NumpyHeadWeights:
    """What a numpy head holds from its config and GGUF tensors (heads.eagle3.Eagle3Head, the tests'
    DFlash oracle; the MLX heads' counterpart: mlx_ops.MlxHeadWeights).

    Args:
        config: an Eagle3Config or DFlashConfig (``check_tensors``, n_vocab, n_embd).
        tensors: GGUF tensor name → array (see the config's ``shapes``); ``d2t`` int64.
        tok_embd: the target's token embeddings (V, H), used when ``tensors`` has no
            ``token_embd.weight`` (llama.cpp then reads the target model's through ctx_other).

    Sets ``config``, ``tensors`` (float32, d2t int64), ``tok_embd`` and ``d2t`` (all V ids when V_d == V).
    """

    def __init__(self, config: Any, tensors: Mapping[str, npt.NDArray], tok_embd: F32 | None) -> None:
        config.check_tensors(tensors)
        self.config = config
        self.tensors = {k: (np.asarray(v, np.int64) if k == "d2t" else np.asarray(v, np.float32))
                        for k, v in tensors.items()}
        want = (config.n_vocab, config.n_embd)
        embd = self.tensors.get("token_embd.weight", tok_embd)
        if embd is None or embd.shape != want:
            raise ValueError(f"the head needs token embeddings of shape {want} (its own or the target's; "
                             f"got {None if embd is None else embd.shape})")
        self.tok_embd = np.asarray(embd, np.float32)
        self.d2t = self.tensors.get("d2t", np.arange(config.n_vocab, dtype=np.int64))


def rms_norm(x: F32, weight: F32, eps: float) -> F32:
    """ggml_rms_norm then × weight, over the last axis."""
    x64 = x.astype(np.float64)
    mean = np.add.reduce(x64 * x64, axis=-1, keepdims=True) / x64.shape[-1]  # np.mean's sum and division, without its overhead
    return (x64 / np.sqrt(mean + eps) * weight).astype(np.float32)


def rope_norm(x: F32, positions: npt.NDArray[np.int64], n_rot: int, base: float,
              freq_factors: F32 | None = None) -> F32:
    """ggml_rope_ext in mode 0 (LLAMA_ROPE_TYPE_NORM): rotate adjacent pairs (x[2i], x[2i+1]) by
    pos·base^(−2i/n_rot) / freq_factors[i] (ggml's freq_factors, e.g. llama3 scaling's rope_freqs;
    None: 1); dims ≥ n_rot pass through. x: (n, heads, head_dim)."""
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv_freq = base ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    theta = positions.astype(np.float64)[:, None] * inv_freq  # (n, n_rot/2)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.astype(np.float64).copy()
    x0, x1 = out[..., 0:n_rot:2].copy(), out[..., 1:n_rot:2].copy()
    out[..., 0:n_rot:2] = x0 * cos - x1 * sin
    out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    return out.astype(np.float32)


def attention(q: F32, k: F32, v: F32, q_pos: npt.NDArray[np.int64], k_pos: npt.NDArray[np.int64],
              scale: float, causal: bool = True) -> F32:
    """softmax(scale·q·kᵀ) · v (``causal``: each query sees keys at positions ≤ its own); GQA: query
    head h reads kv head h // (n_head / n_head_kv). q: (n, n_head, d), k/v: (m, n_head_kv, d) → (n, n_head·d)."""
    n, n_head, d = q.shape
    group = n_head // k.shape[1]
    kh = np.repeat(k.astype(np.float64), group, axis=1)  # (m, n_head, d)
    vh = np.repeat(v.astype(np.float64), group, axis=1)
    s = np.einsum("nhd,mhd->hnm", q.astype(np.float64), kh) * scale
    if causal:
        s = np.where(k_pos[None, None, :] <= q_pos[None, :, None], s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("hnm,mhd->nhd", s, vh).reshape(n, n_head * d).astype(np.float32)


def silu(x: F32) -> F32:
    """x · sigmoid(x)."""
    return (x / (1.0 + np.exp(-x.astype(np.float64)))).astype(np.float32)
